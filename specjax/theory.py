"""What speculative decoding should gain, from Leviathan et al. (2023), section 3.

alpha: the probability that the target accepts a draft token (E[sum_v min(p, q)]);
K: draft tokens per step; c: the cost of one draft step over one target pass.
Pure arithmetic: it knows nothing about models or JAX.
"""

from __future__ import annotations


def expected_tokens_per_pass(alpha: float, K: int) -> float:
    """E[tokens per target pass] = (1 - alpha^(K+1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if alpha == 1.0:
        return K + 1.0
    return (1.0 - alpha ** (K + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, K: int, c: float) -> float:
    """Walltime speedup over autoregressive decoding: E[tokens per pass] / (K c + 1)."""
    return expected_tokens_per_pass(alpha, K) / (K * c + 1.0)


def best_num_draft_tokens(alpha: float, c: float, max_k: int = 16) -> int:
    """The K in 1..max_k with the highest predicted speedup."""
    return max(range(1, max_k + 1), key=lambda k: predicted_speedup(alpha, k, c))


def alpha_from_accepted(accepted_per_step: float, K: int, tol: float = 1e-9) -> float:
    """Inverts E[accepted drafts per step] = sum_{i=1..K} alpha^i (monotone in alpha)."""
    if not 0.0 <= accepted_per_step <= K:
        raise ValueError(f"accepted per step must lie in [0, {K}], got {accepted_per_step}")
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, K + 1)) < accepted_per_step:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
