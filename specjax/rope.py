"""Rotary embedding's frequencies as transformers computes them, for every rope type specjax
reads (config.ROPE_TYPES: default, linear, llama3, yarn) and for a rotary over part of each
head (`ModelConfig.rotary_dim`), and the factor YaRN scales cos and sin by.

It takes a ModelConfig (duck-typed: config.py imports this module, never the reverse) and
returns numpy arrays; which lanes the angles rotate, and how, is models/layers.py's
(`rotary_angles`, `rotary`).
"""

from __future__ import annotations

import math


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 mscale log(scale) + 1 (1 for scale <= 1): transformers' yarn_get_mscale."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(config, local: bool = False):
    """Rotary inverse frequencies [D'/2] as transformers computes them (numpy float64), of
    the full-attention layers, or (local=True) of the sliding-window layers. D' is the lanes
    rotary rotates (`ModelConfig.rotary_dim`: D but where partial_rotary_factor < 1), whose
    width every rope type's frequencies are computed for, as transformers' `dim`."""
    import numpy as np

    D = config.rotary_dim
    if local and config.local_rope_theta is not None:  # Gemma 3: its own base, unscaled
        return 1.0 / (config.local_rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    s = config.rope_scaling
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled)
    if s.rope_type == "yarn":  # transformers' _compute_yarn_parameters
        def correction_dim(rotations):  # the dimension that turns `rotations` times over the original length
            return D * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(config.rope_theta))
        low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, D - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(D // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp  # the share of each frequency left unscaled
        return inv_freq / s.factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq


def rope_cos_sin_factor(config, local: bool = False) -> float:
    """What the rotary tables' cos and sin are multiplied by (RopeScaling.cos_sin_factor) for
    the full-attention layers, or (local=True) the sliding-window layers (Gemma 3's unscaled
    local rope: 1)."""
    if local and config.local_rope_theta is not None:
        return 1.0
    return config.rope_scaling.cos_sin_factor()
