"""specjax: speculative decoding for JAX/Flax programs.

The public API, re-exports only.
"""

from specjax.cache import KVCache
from specjax.config import ModelConfig, UnsupportedConfigError
from specjax.hf import CheckpointError, load_model, load_tokenizer, save_model
from specjax.models import Model, forward

__all__ = [
    "CheckpointError", "KVCache", "Model", "ModelConfig", "UnsupportedConfigError",
    "forward", "load_model", "load_tokenizer", "save_model",
]
