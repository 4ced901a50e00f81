"""What speculative decoding should gain, from Leviathan et al. (2023), section 3, and the
choice of K it implies for a measured cost profile.

alpha: the probability that the target accepts a draft token (E[sum_v min(p, q)]);
K: draft tokens per step; c: the cost of one draft step over one target pass.
A `CostProfile` (written by `specjax bench --profile`, a CPU default shipped in
specjax/profiles/) holds the measured time of one whole loop step by batch size and K (the
drafts, the verification pass, acceptance and bookkeeping: what a step really costs), and
the per-position acceptance a_i = P(draft i accepted | drafts 1..i-1 accepted) of one drafter;
and, for trees, the same for each measured node budget of a dynamic tree family
(`TreeBudgets`: a step's time and how deep its accepted path reaches). A batch runs until
its slowest row is done, so the choice of K (or of a node budget) weighs the expected
number of steps of the slowest of B rows, not one row's; an engine's slots are refilled as
each row finishes, so its choice (`choose_slot_k`) weighs one row's tokens per step. The
acceptance it weighs is read from what a call kept per step (`row_traces` of a
return_trace=True call; `per_position_acceptance`, `depth_acceptance`). Pure arithmetic,
numpy and JSON: it knows nothing about models or JAX.
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


# ---- a mixture of experts' verification pass ---------------------------------------------


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """E[distinct experts a pass of `tokens` tokens routes to] in a layer of X experts, each
    token choosing top_k of them, as if uniformly and independently: X (1 - (1 - k/X)^T).
    One token reads k experts; a verification pass of K+1 tokens per row reads more, up to
    all X: what makes speculation cost more over a MoE target than over a dense one. Real
    routers are skewed and a row's consecutive tokens share experts, so this bounds the
    cost from above."""
    if not 1 <= top_k <= num_experts or tokens < 0:
        raise ValueError(f"need 1 <= top_k <= num_experts and tokens >= 0, got {top_k}, {num_experts}, {tokens}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def moe_pass_bytes(dense_bytes: float, expert_bytes: float, num_experts: int, top_k: int, tokens: int) -> float:
    """Weight bytes a memory-bound pass of `tokens` tokens reads: the dense part (attention,
    norms, head, shared experts: read whatever the tokens) and each expert touched
    (`expected_experts`, expert_bytes each, all sparse layers together)."""
    return dense_bytes + expert_bytes * expected_experts(num_experts, top_k, tokens)


# ---- choosing K per batch size from a measured cost profile -----------------------------

PROFILE_FORMAT, PROFILE_VERSION = "specjax-cost-profile", 2


def _at_batch(batches: tuple[int, ...], values: list[float], batch: int) -> float:
    """A cost measured at each of `batches`, at another batch size: interpolated linearly
    between measured sizes, the smallest's below them, growing along the last two above."""
    if len(batches) == 1 or batch <= batches[0]:
        return values[0]
    i = next((j for j in range(1, len(batches)) if batch <= batches[j]), len(batches) - 1)
    slope = (values[i] - values[i - 1]) / (batches[i] - batches[i - 1])
    return max(values[i - 1] + slope * (batch - batches[i - 1]), min(values[i - 1], values[i]))


@dataclasses.dataclass(frozen=True)
class TreeBudgets:
    """Measured node budgets of one dynamic tree family, Tree(depth, top_k, n) for n in nodes."""

    depth: int  # D
    top_k: int  # C
    nodes: tuple[int, ...]  # the node budgets measured, ascending
    step_ms: tuple[tuple[float, ...], ...]  # [batch][j]: one loop step verifying nodes[j] drafts
    reach: tuple[tuple[float, ...], ...]  # [j][d - 1]: P(a step keeps >= d drafts), d = 1..depth

    def __post_init__(self):
        n = self.nodes
        if not n or any(not isinstance(x, int) or x < 1 for x in n) or list(n) != sorted(set(n)):
            raise ValueError(f"cost profile tree budgets must be ascending distinct ints >= 1, got {list(n)}")
        if not (isinstance(self.depth, int) and isinstance(self.top_k, int) and self.depth >= 1
                and self.top_k >= 1):
            raise ValueError(f"cost profile tree depth and top_k must be ints >= 1, got {self.depth}, {self.top_k}")
        if any(len(row) != len(n) or any(not t > 0 for t in row) for row in self.step_ms):
            raise ValueError(f"cost profile tree step_ms rows must hold one positive time per budget {list(n)}")
        if len(self.reach) != len(n) or any(len(r) != self.depth for r in self.reach):
            raise ValueError(f"cost profile tree reach needs, per budget, one value per depth 1..{self.depth}")
        if any(not 0.0 <= a <= 1.0 for r in self.reach for a in r) or any(
                later > earlier + 1e-9 for r in self.reach for earlier, later in zip(r, r[1:])):
            raise ValueError("cost profile tree reach values must lie in [0, 1] and never grow with depth")

    def cost(self, batches: tuple[int, ...], batch: int, j: int) -> float:
        """Milliseconds of one step with budget nodes[j] (non-decreasing in the budget)."""
        return _at_batch(batches, [max(row[: j + 1]) for row in self.step_ms], batch)

    @classmethod
    def from_dict(cls, d: dict) -> "TreeBudgets":
        return cls(int(d["depth"]), int(d["top_k"]), tuple(int(n) for n in d["nodes"]),
                   tuple(tuple(map(float, r)) for r in d["step_ms"]), tuple(tuple(map(float, r)) for r in d["reach"]))

    def to_dict(self) -> dict:
        return {"depth": self.depth, "top_k": self.top_k, "nodes": list(self.nodes),
                "step_ms": [list(r) for r in self.step_ms], "reach": [list(r) for r in self.reach]}


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """Measured costs of one loop step, and how often one drafter's drafts are accepted.

    `step_ms[b][K]` is one whole step of `generate`'s loop at batch size `batches[b]` with K
    drafts per row (K = 0: plain decoding), measured in the compiled loop."""

    batches: tuple[int, ...]  # batch sizes measured, ascending
    step_ms: tuple[tuple[float, ...], ...]  # [batch][K]: one loop step with K = 0.. drafts
    acceptance: tuple[float, ...]  # a_i for i = 1..: P(draft i accepted | drafts before it were)
    trees: tuple[TreeBudgets, ...] = ()  # node budgets measured per dynamic tree family
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
        if any(len(t.step_ms) != len(b) for t in self.trees):
            raise ValueError(f"cost profile: tree step_ms needs one entry per batch size ({len(b)})")
        families = [(t.depth, t.top_k) for t in self.trees]
        if len(set(families)) != len(families):
            raise ValueError(f"cost profile: a tree family appears twice in {families}")

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
        return _at_batch(self.batches, [max(row[: K + 1]) for row in self.step_ms], batch)

    def tree_family(self, depth: int, top_k: int) -> TreeBudgets:
        """The node budgets measured for dynamic trees Tree(depth, top_k, n)."""
        for t in self.trees:
            if (t.depth, t.top_k) == (depth, top_k):
                return t
        measured = ", ".join(f"Tree({t.depth}, {t.top_k}, n)" for t in self.trees) or "no trees"
        raise ValueError(f"the cost profile measured {measured}, not Tree({depth}, {top_k}, n): measure that "
                         f"family with `specjax bench --profile --profile-tree {depth},{top_k} --tree-nodes N ...`")

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a specjax cost profile (format {PROFILE_FORMAT!r} expected)")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"cost profile version {d.get('version')!r}; this specjax reads {PROFILE_VERSION}: "
                             f"measure it again with `specjax bench --profile`")
        try:
            return cls(tuple(int(b) for b in d["batches"]), tuple(tuple(map(float, r)) for r in d["step_ms"]),
                       tuple(map(float, d["acceptance"])), tuple(TreeBudgets.from_dict(t) for t in d.get("trees", [])),
                       {k: v for k, v in d.items() if k not in ("batches", "step_ms", "acceptance", "trees")})
        except KeyError as e:
            raise ValueError(f"cost profile lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if "cost profile" in str(e):
                raise
            raise ValueError(f"cost profile has a malformed entry: {e}") from None

    def to_dict(self) -> dict:
        return {**self.meta, "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "batches": list(self.batches),
                "step_ms": [list(r) for r in self.step_ms], "acceptance": list(self.acceptance),
                **({"trees": [t.to_dict() for t in self.trees]} if self.trees else {})}

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


def chain_reach(acceptance, K: int) -> tuple[float, ...]:
    """P(a step keeps >= k drafts), k = 1..K, of a chain: a_1 a_2 ... a_k."""
    if K > len(acceptance):
        raise ValueError(f"acceptance is known for {len(acceptance)} positions, not K = {K}")
    return tuple(float(r) for r in np.cumprod(np.asarray(acceptance[:K], np.float64)))


@functools.lru_cache(maxsize=256)
def expected_steps(reach: tuple[float, ...], batch: int, max_new_tokens: int, samples: int = 256) -> float:
    """E[loop steps until every one of `batch` rows has max_new_tokens tokens], each row
    keeping 1 + n tokens per step with P(n >= k) = reach[k - 1] independently (a Monte Carlo
    estimate with a fixed seed: deterministic). No reach (no drafts): exactly max_new_tokens."""
    if not reach:
        return float(max_new_tokens)
    reach = np.asarray(reach, np.float64)
    rng = np.random.default_rng(0)
    made = np.zeros((samples, batch), np.int64)
    steps = np.zeros((samples,), np.int64)
    while (going := (made < max_new_tokens).any(axis=1)).any():
        u = rng.random((samples, batch, 1))
        n = (u < reach).sum(axis=2)  # one draw per row: n >= k exactly when u < reach[k-1]
        made += np.where(made < max_new_tokens, n + 1, 0)
        steps += going
    return float(steps.mean())


def _throughput(reach: tuple[float, ...], step_ms: float, batch: int, max_new_tokens: int) -> float:
    """batch x max_new_tokens over the slowest row's expected steps times one step's cost."""
    return batch * max_new_tokens / (expected_steps(reach, batch, max_new_tokens) * step_ms)


def tokens_per_ms(profile: CostProfile, batch: int, K: int, max_new_tokens: int = 64) -> float:
    """Predicted throughput with K drafts (`_throughput` of the chain's reach and step)."""
    return _throughput(chain_reach(profile.acceptance, K), profile.cost(batch, K), batch, max_new_tokens)


# Speculation is turned on only where it is predicted to beat plain decoding by this factor:
# a profile measured on a real machine is noisy at about this level, so a smaller predicted
# gain is as likely a small loss. On the 2-core CPU the shipped profile comes from, steps
# came out of order by up to 12% (docs/bench/profile.txt: batch 1, K=2 3.68 ms, K=3 3.29 ms)
# and plain decoding at batches 1 and 4 measured 8-11% apart within one bench run
# (docs/bench/auto_k.txt: 577.6 vs 622.6 and 1523.9 vs 1687.2 tokens/s).
MIN_GAIN = 1.1


def _check_choice(batch, max_new_tokens, min_gain):
    if not min_gain >= 1.0:
        raise ValueError(f"min_gain must be >= 1 (speculation must at least break even), got {min_gain!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")


def _best_or_off(rate: dict[int, float], off: float, min_gain: float) -> int:
    """The shape (K or node budget) with the most tokens per ms, a larger one only when
    strictly better; 0 (speculation off) unless it beats plain decoding's `off` by min_gain."""
    best = max(rate, key=lambda n: (rate[n], -n), default=0)
    return best if best and rate[best] >= min_gain * off else 0


def choose_num_draft_tokens(profile: CostProfile, batch: int, max_k: int | None = None,
                            max_new_tokens: int = 64, min_gain: float = MIN_GAIN, among=None) -> int:
    """The K in 1..max_k (default: all the profile prices; among: only these Ks) with the
    most tokens per millisecond (`tokens_per_ms`), or 0 (speculation off) unless that K is
    predicted to beat plain decoding by min_gain (`_best_or_off`)."""
    _check_choice(batch, max_new_tokens, min_gain)
    top = profile.max_k if max_k is None else min(max_k, profile.max_k)
    ks = range(1, top + 1) if among is None else sorted(K for K in among if 1 <= K <= top)
    rate = {K: tokens_per_ms(profile, batch, K, max_new_tokens) for K in ks}
    return _best_or_off(rate, tokens_per_ms(profile, batch, 0, max_new_tokens), min_gain)


def choose_slot_k(acceptance, step_ms: dict[int, float], rows: int, min_gain: float = MIN_GAIN) -> int:
    """K for `rows` live rows of an engine, whose slots are refilled as each row finishes (so
    its throughput is rows x one row's expected tokens per step over a step's cost, not a
    batch's slowest row's): of the Ks priced in step_ms ({K: ms of one step at this load}),
    the one with the most tokens per ms; 0 (speculation off) unless that beats K = 0's by
    min_gain, where step_ms prices K = 0 (where it does not, speculation cannot be off: the
    best K). acceptance: per position, as `expected_tokens_per_step` takes it."""
    _check_choice(rows, 1, min_gain)
    if not step_ms or any(not t > 0 for t in step_ms.values()):
        raise ValueError(f"step_ms must price at least one K with a positive time, got {step_ms!r}")
    rate = {K: rows * expected_tokens_per_step(acceptance, K) / t for K, t in step_ms.items() if K}
    if 0 not in step_ms:
        return max(rate, key=lambda K: (rate[K], -K))
    return _best_or_off(rate, rows / step_ms[0], min_gain)


def tree_tokens_per_ms(profile: CostProfile, depth: int, top_k: int, nodes: int, batch: int,
                       max_new_tokens: int = 64) -> float:
    """Predicted throughput of a dynamic Tree(depth, top_k, nodes) whose budget the profile
    measured (`_throughput` of that budget's measured reach and step)."""
    family = profile.tree_family(depth, top_k)
    if nodes not in family.nodes:
        raise ValueError(f"the cost profile measured Tree({depth}, {top_k}, n) for n in {list(family.nodes)}, "
                         f"not n = {nodes}")
    j = family.nodes.index(nodes)
    return _throughput(family.reach[j], family.cost(profile.batches, batch, j), batch, max_new_tokens)


def choose_tree_nodes(profile: CostProfile, depth: int, top_k: int, batch: int, max_nodes: int,
                      max_new_tokens: int = 64, min_gain: float = MIN_GAIN) -> int:
    """The node budget for a dynamic Tree(depth, top_k, n): of the budgets the profile
    measured for that family up to max_nodes, the one with the most tokens per millisecond
    (`tree_tokens_per_ms`), or 0 (speculation off) unless it is predicted to beat plain
    decoding by min_gain (`_best_or_off`)."""
    _check_choice(batch, max_new_tokens, min_gain)
    family = profile.tree_family(depth, top_k)
    fits = [n for n in family.nodes if n <= max_nodes]
    if not fits:
        raise ValueError(f"the cost profile measured Tree({depth}, {top_k}, n) for n in {list(family.nodes)}, "
                         f"none within this tree's {max_nodes} nodes")
    rate = {n: tree_tokens_per_ms(profile, depth, top_k, n, batch, max_new_tokens) for n in fits}
    return _best_or_off(rate, tokens_per_ms(profile, batch, 0, max_new_tokens), min_gain)


def resolve_profile(cost_profile, backend: str) -> CostProfile | None:
    """A `CostProfile`, a profile.json path, or None (the profile shipped for `backend`, or
    None where none is shipped: see `generate.auto_shape`)."""
    if cost_profile is None:
        if not (resources.files("specjax") / "profiles" / f"{backend}.json").is_file():
            return None
        return default_profile(backend)
    if isinstance(cost_profile, CostProfile):
        return cost_profile
    if isinstance(cost_profile, (str, Path)):
        return CostProfile.load(cost_profile)
    raise TypeError(f"cost_profile must be a specjax.CostProfile, a path or None, got {type(cost_profile).__name__}")


# ---- acceptance as measured: from the tokens each step kept ------------------------------


def row_traces(out) -> list[list[int]]:
    """A GenerateOutput's (with return_trace) tokens per step, row by row."""
    trace, steps = np.asarray(out.trace), np.asarray(out.stats.steps)
    return [trace[b, : steps[b]].tolist() for b in range(trace.shape[0])]


def depth_acceptance(traces: list[list[int]], depth: int) -> list[float]:
    """Per depth k = 1..depth, the fraction of steps that kept at least k drafted tokens,
    from each row's tokens per step (accepted + 1); a row's last step, which may be cut
    short, is left out."""
    accepted = np.array([c - 1 for t in traces for c in t[:-1]])
    return [float(np.mean(accepted >= k)) if accepted.size else 0.0 for k in range(1, depth + 1)]


def per_position_acceptance(traces: list[list[int]], K: int) -> list[float]:
    """P(draft i accepted | drafts 1..i-1 accepted), from tokens emitted per step (n + 1 in
    a step that was not cut short; the last step of a row may be, and is left out)."""
    accepted = np.array([c - 1 for t in traces for c in t[:-1]])
    if accepted.size == 0:
        return []
    return [float(np.mean(accepted[accepted >= i - 1] >= i)) if np.any(accepted >= i - 1) else 0.0
            for i in range(1, K + 1)]
