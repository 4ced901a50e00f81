"""What speculative decoding should gain, from Leviathan et al. (2023), section 3, and the
choice of K it implies for a measured cost profile.

alpha: the probability that the target accepts a draft token (E[sum_v min(p, q)]);
K: draft tokens per step; c: the cost of one draft step over one target pass.
A `CostProfile` (written by `specjax bench --profile`, a CPU default shipped in
specjax/profiles/) holds measured pass times by batch size and tokens per pass, and the
per-position acceptance a_i = P(draft i accepted | drafts 1..i-1 accepted) of one drafter.
Pure arithmetic and JSON: it knows nothing about models or JAX.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path


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

PROFILE_FORMAT, PROFILE_VERSION = "specjax-cost-profile", 1


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """Measured costs of one speculative step, and how often drafts are accepted.

    A step with K drafts at batch B costs K draft steps and one target pass over K+1
    tokens per row; K = 0 is plain decoding (one target pass over 1 token, no draft)."""

    batches: tuple[int, ...]  # batch sizes measured, ascending
    target_ms: tuple[tuple[float, ...], ...]  # [batch][T-1]: one target pass over T = 1.. tokens per row
    draft_ms: tuple[float, ...]  # [batch]: one draft step (0 for drafters that run no model)
    acceptance: tuple[float, ...]  # a_i for i = 1..: P(draft i accepted | drafts before it were)
    meta: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)  # where it came from

    def __post_init__(self):
        b = self.batches
        if not b or any(not isinstance(x, int) or x < 1 for x in b) or list(b) != sorted(set(b)):
            raise ValueError(f"cost profile batches must be ascending distinct ints >= 1, got {list(b)}")
        if len(self.target_ms) != len(b) or len(self.draft_ms) != len(b):
            raise ValueError(f"cost profile: target_ms and draft_ms need one entry per batch size ({len(b)}), "
                             f"got {len(self.target_ms)} and {len(self.draft_ms)}")
        for row in self.target_ms:
            if len(row) < 1 or any(not t > 0 for t in row):
                raise ValueError(f"cost profile target_ms rows must be positive times for T = 1.., got {list(row)}")
        if any(not t >= 0 for t in self.draft_ms):
            raise ValueError(f"cost profile draft_ms must be >= 0, got {list(self.draft_ms)}")
        if any(not 0.0 <= a <= 1.0 for a in self.acceptance):
            raise ValueError(f"cost profile acceptance values must lie in [0, 1], got {list(self.acceptance)}")

    @property
    def max_k(self) -> int:
        """The deepest K the profile can price: measured acceptance and passes over K+1 tokens."""
        return min(len(self.acceptance), min(len(row) for row in self.target_ms) - 1)

    def step_ms(self, batch: int, K: int) -> float:
        """Predicted milliseconds of one step: K draft steps + a target pass over K+1 tokens.
        Pass costs are taken non-decreasing in T (the largest measured up to T+1 tokens,
        so that timing noise cannot make a longer pass look cheaper); between measured batch
        sizes costs are interpolated linearly; below the smallest the
        smallest's are used; above the largest they grow linearly along the last two."""
        if not 0 <= K <= self.max_k:
            raise ValueError(f"the cost profile prices K in 0..{self.max_k}, not {K}")

        def at(values):
            b = self.batches
            if len(b) == 1 or batch <= b[0]:
                return values[0]
            i = next((j for j in range(1, len(b)) if batch <= b[j]), len(b) - 1)
            slope = (values[i] - values[i - 1]) / (b[i] - b[i - 1])
            return max(values[i - 1] + slope * (batch - b[i - 1]), min(values[i - 1], values[i]))

        # A pass over more tokens never costs less: measured noise is evened out upwards.
        return at([max(row[: K + 1]) for row in self.target_ms]) + (K * at(self.draft_ms) if K else 0.0)

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a specjax cost profile (format {PROFILE_FORMAT!r} expected)")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"cost profile version {d.get('version')!r}; this specjax reads {PROFILE_VERSION}")
        try:
            return cls(tuple(int(b) for b in d["batches"]), tuple(tuple(map(float, r)) for r in d["target_ms"]),
                       tuple(map(float, d["draft_ms"])), tuple(map(float, d["acceptance"])),
                       {k: v for k, v in d.items() if k not in ("batches", "target_ms", "draft_ms", "acceptance")})
        except KeyError as e:
            raise ValueError(f"cost profile lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if "cost profile" in str(e):
                raise
            raise ValueError(f"cost profile has a malformed entry: {e}") from None

    def to_dict(self) -> dict:
        return {**self.meta, "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "batches": list(self.batches),
                "target_ms": [list(r) for r in self.target_ms], "draft_ms": list(self.draft_ms),
                "acceptance": list(self.acceptance)}

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


def choose_num_draft_tokens(profile: CostProfile, batch: int, max_k: int | None = None) -> int:
    """The K in 0..max_k (default: all the profile prices) with the most tokens per
    millisecond, E[tokens per step] / step cost; 0 turns speculation off. A larger K must
    be strictly better to be chosen."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    top = profile.max_k if max_k is None else min(max_k, profile.max_k)
    rate = [expected_tokens_per_step(profile.acceptance, K) / profile.step_ms(batch, K) for K in range(top + 1)]
    return max(range(top + 1), key=lambda K: (rate[K], -K))
