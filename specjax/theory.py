"""What speculative decoding should gain, from Leviathan et al. (2023), section 3, and the
choice of K it implies for a measured cost profile.

alpha: the probability that the target accepts a draft token (E[sum_v min(p, q)]);
K: draft tokens per step; c: the cost of one draft step over one target pass.
A `CostProfile` (written by `specjax bench --profile`, a CPU default shipped in
specjax/profiles/) holds the measured time of one whole loop step by batch size and K (the
drafts, the verification pass, acceptance and bookkeeping: what a step really costs), and
the per-position acceptance a_i = P(draft i accepted | drafts 1..i-1 accepted) of one drafter.
A batch runs until its slowest row is done, so the choice of K weighs the expected number
of steps of the slowest of B rows, not one row's. Pure arithmetic, numpy and JSON: it knows
nothing about models or JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from pathlib import Path

import numpy as np


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


# ---- choosing K per batch size from a measured cost profile -----------------------------

PROFILE_FORMAT, PROFILE_VERSION = "specjax-cost-profile", 2


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """Measured costs of one loop step, and how often one drafter's drafts are accepted.

    step_ms[b][K] is one whole step of `generate`'s loop at batch size batches[b] with K
    drafts per row (K = 0: plain decoding), measured in the compiled loop."""

    batches: tuple[int, ...]  # batch sizes measured, ascending
    step_ms: tuple[tuple[float, ...], ...]  # [batch][K]: one loop step with K = 0.. drafts
    acceptance: tuple[float, ...]  # a_i for i = 1..: P(draft i accepted | drafts before it were)
    meta: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)  # where it came from

    def __post_init__(self):
        b = self.batches
        if not b or any(not isinstance(x, int) or x < 1 for x in b) or list(b) != sorted(set(b)):
            raise ValueError(f"cost profile batches must be ascending distinct ints >= 1, got {list(b)}")
        if len(self.step_ms) != len(b):
            raise ValueError(f"cost profile: step_ms needs one entry per batch size ({len(b)}), "
                             f"got {len(self.step_ms)}")
        for row in self.step_ms:
            if len(row) < 1 or any(not t > 0 for t in row):
                raise ValueError(f"cost profile step_ms rows must be positive times for K = 0.., got {list(row)}")
        if any(not 0.0 <= a <= 1.0 for a in self.acceptance):
            raise ValueError(f"cost profile acceptance values must lie in [0, 1], got {list(self.acceptance)}")

    @property
    def max_k(self) -> int:
        """The deepest K the profile can price: measured acceptance and steps."""
        return min(len(self.acceptance), min(len(row) for row in self.step_ms) - 1)

    def cost(self, batch: int, K: int) -> float:
        """Milliseconds of one step with K drafts at this batch size. Steps are taken
        non-decreasing in K (the largest measured up to K, so that timing noise cannot make
        more drafts look cheaper); between measured batch sizes costs are interpolated
        linearly; below the smallest the smallest's are used; above the largest they grow
        linearly along the last two."""
        if not 0 <= K <= self.max_k:
            raise ValueError(f"the cost profile prices K in 0..{self.max_k}, not {K}")
        values = [max(row[: K + 1]) for row in self.step_ms]
        b = self.batches
        if len(b) == 1 or batch <= b[0]:
            return values[0]
        i = next((j for j in range(1, len(b)) if batch <= b[j]), len(b) - 1)
        slope = (values[i] - values[i - 1]) / (b[i] - b[i - 1])
        return max(values[i - 1] + slope * (batch - b[i - 1]), min(values[i - 1], values[i]))

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a specjax cost profile (format {PROFILE_FORMAT!r} expected)")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"cost profile version {d.get('version')!r}; this specjax reads {PROFILE_VERSION}: "
                             f"measure it again with `specjax bench --profile`")
        try:
            return cls(tuple(int(b) for b in d["batches"]), tuple(tuple(map(float, r)) for r in d["step_ms"]),
                       tuple(map(float, d["acceptance"])),
                       {k: v for k, v in d.items() if k not in ("batches", "step_ms", "acceptance")})
        except KeyError as e:
            raise ValueError(f"cost profile lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if "cost profile" in str(e):
                raise
            raise ValueError(f"cost profile has a malformed entry: {e}") from None

    def to_dict(self) -> dict:
        return {**self.meta, "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "batches": list(self.batches),
                "step_ms": [list(r) for r in self.step_ms], "acceptance": list(self.acceptance)}

    @classmethod
    def load(cls, path) -> "CostProfile":
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"no cost profile at {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"cost profile {path} is not JSON: {e}") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def default_profile(backend: str = "cpu") -> CostProfile:
    """The profile shipped for a JAX backend (specjax/profiles/BACKEND.json)."""
    source = resources.files("specjax") / "profiles" / f"{backend}.json"
    if not source.is_file():
        raise ValueError(f"no cost profile is shipped for the {backend!r} backend: measure one with "
                         f"`specjax bench --profile` and pass cost_profile=PATH")
    return CostProfile.from_dict(json.loads(source.read_text()))


def expected_tokens_per_step(acceptance, K: int) -> float:
    """1 + sum_{k=1..K} prod_{i<=k} a_i: tokens a step keeps with K drafts (the target's own
    token included), for per-position acceptance a_1, a_2, ..."""
    if K > len(acceptance):
        raise ValueError(f"acceptance is known for {len(acceptance)} positions, not K = {K}")
    total, reach = 1.0, 1.0
    for a in acceptance[:K]:
        reach *= a
        total += reach
    return total


@functools.lru_cache(maxsize=256)
def expected_steps(acceptance: tuple[float, ...], K: int, batch: int, max_new_tokens: int,
                   samples: int = 256) -> float:
    """E[loop steps until every one of `batch` rows has max_new_tokens tokens], each row
    keeping 1 + n tokens per step with P(n >= k) = a_1...a_k independently (a Monte Carlo
    estimate with a fixed seed: deterministic). K = 0: exactly max_new_tokens."""
    if K == 0:
        return float(max_new_tokens)
    reach = np.cumprod(np.asarray(acceptance[:K], np.float64))  # P(n >= k), k = 1..K
    rng = np.random.default_rng(0)
    made = np.zeros((samples, batch), np.int64)
    steps = np.zeros((samples,), np.int64)
    while (going := (made < max_new_tokens).any(axis=1)).any():
        n = (rng.random((samples, batch, 1)) < reach).sum(axis=2)  # leading accepts
        made += np.where(made < max_new_tokens, n + 1, 0)
        steps += going
    return float(steps.mean())


def tokens_per_ms(profile: CostProfile, batch: int, K: int, max_new_tokens: int = 64) -> float:
    """Predicted throughput with K drafts: batch x max_new_tokens over the slowest row's
    expected steps times one step's cost."""
    steps = expected_steps(tuple(profile.acceptance), K, batch, max_new_tokens)
    return batch * max_new_tokens / (steps * profile.cost(batch, K))


def choose_num_draft_tokens(profile: CostProfile, batch: int, max_k: int | None = None,
                            max_new_tokens: int = 64) -> int:
    """The K in 0..max_k (default: all the profile prices) with the most tokens per
    millisecond (`tokens_per_ms`); 0 turns speculation off. A larger K must be strictly
    better to be chosen."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    top = profile.max_k if max_k is None else min(max_k, profile.max_k)
    rate = [tokens_per_ms(profile, batch, K, max_new_tokens) for K in range(top + 1)]
    return max(range(top + 1), key=lambda K: (rate[K], -K))
