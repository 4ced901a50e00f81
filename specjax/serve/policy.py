"""`KPolicy`: how many tokens the engine drafts per step (K) for each number of live rows,
the speculation counts it is re-chosen from, and how many steps a device call runs.

A table `K by live rows` is given, or chosen from a cost profile (`theory.choose_slot_k`
over each K's step cost at the width that many rows run in), then chosen again at the steps'
own costs once they are timed (`price`) and as the traffic shows how well drafts are
accepted (`record`, every ADAPT_DRAFTS drafted steps). It knows costs, acceptance and Ks;
nothing of requests, slots' contents, threads or what a step computes: the engine tells it
the Ks it compiled and the width n live rows run in (`bind`).
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from specjax import theory

DEFAULT_K = 4  # the chain's length where no cost profile chooses it
# A profile's table is re-chosen every ADAPT_DRAFTS drafted steps from the acceptance seen so
# far (`KPolicy.acceptance`), in which a draft position counts once SEEN drafts reached it.
ADAPT_DRAFTS = 256
SEEN = 64
# A device call aims to last about CALL_MS (its steps at their timed costs): the host frees
# finished rows' slots and admits waiting requests only between calls, and the next call is
# queued before the last is read, so a request that arrives at a full batch waits one to two
# calls (docs/bench/serve_call_length.txt).
CALL_MS = 20.0


def verify_cost(config):
    """(n rows, K) -> what a verification pass of K + 1 tokens a row costs over a plain pass
    of one, beyond a dense target's: for a mixture of experts the weight bytes it reads
    (`theory.moe_pass_bytes`, experts touched by n (K + 1) tokens against n), else 1."""
    if config is None or config.moe is None:
        return lambda n, K: 1.0
    m = config.moe
    expert = 3 * config.hidden_size * m.expert_size * sum(map(config.sparse, range(config.num_layers)))  # [every layer]
    dense = config.num_params() - m.num_experts * expert  # the rest (router, shared experts too): read whatever the tokens

    def reads(tokens):
        return theory.moe_pass_bytes(dense, expert, m.num_experts, m.top_k, tokens)

    return lambda n, K: reads(n * (K + 1)) / reads(n)


class KPolicy:
    """K by live rows (`table[n - 1]` for n live rows) and vLLM's speculation counts: a draft
    is one row's drafted step; accepted tokens are the drafted tokens the target kept (a
    step's emitted tokens but its own one); accepted_per_position[i]: drafts whose (i+1)-th
    drafted token was accepted."""

    def __init__(self, drafter, num_draft_tokens, cost_profile, slots: int, target_config=None):
        """target_config: the target's ModelConfig; a mixture of experts' prices the profile's
        steps (measured over a dense target) the dearer for the experts a verification pass
        touches beyond one token's (`verify_cost`)."""
        self.slots = slots
        self.verify_cost = verify_cost(target_config)
        self.profile = None  # the cost profile the table came from (None: given, or none shipped)
        self.least_k = 0  # 1 for a drafter that reads the target's states of every step: it never skips one
        self.step_ms = None  # {K: {width: ms of a step}}, as the engine timed them (`price`)
        self.table = self._initial(drafter, num_draft_tokens, cost_profile)
        self.drafts = self.draft_tokens = self.accepted = 0
        self.accepted_per_position = collections.Counter()
        self.drafted = collections.Counter()  # drafted steps per K
        self.accepted_at = collections.defaultdict(collections.Counter)  # K -> i -> drafts whose (i+1)-th was accepted
        self._adapted = 0  # self.drafts when the table was last re-chosen
        self._compiled: list[int] = sorted(set(self.table))
        self._width = lambda n: n

    @property
    def may_turn_off(self) -> bool:
        """A table the profile chose may turn drafting off once the traffic shows it drafted
        badly: K = 0 must be compiled beside its Ks."""
        return self.profile is not None and not self.least_k

    def bind(self, compiled, width) -> "KPolicy":
        """The Ks the engine compiled (what a table may choose among) and width(n): the rows
        a step runs with n live ones."""
        self._compiled, self._width = sorted(compiled), width
        return self

    def _initial(self, drafter, num_draft_tokens, cost_profile) -> tuple[int, ...]:
        if drafter is None:
            if num_draft_tokens not in (None, 0):
                raise ValueError(f"num_draft_tokens={num_draft_tokens!r} needs a draft")
            return (0,) * self.slots
        if drafter.tree is not None or drafter.fixed_shape:
            if num_draft_tokens is not None:
                raise ValueError(f"{type(drafter).__name__} fixes its own shape: leave num_draft_tokens unset")
            return (drafter.resolve(None).tree.nodes,) * self.slots
        low = self.least_k = 1 if drafter.wants_features else 0
        if isinstance(num_draft_tokens, (int, np.integer)) and not isinstance(num_draft_tokens, bool):
            num_draft_tokens = (num_draft_tokens,) * self.slots
        if num_draft_tokens is not None:
            table = tuple(num_draft_tokens) if isinstance(num_draft_tokens, (tuple, list)) else ()
            if (len(table) != self.slots or any(not isinstance(K, (int, np.integer)) or isinstance(K, bool)
                                                or K < low for K in table)):
                raise ValueError(f"num_draft_tokens must be an int >= {max(low, 1)}, {self.slots} ints >= {low} "
                                 f"(K by live rows) or None, got {num_draft_tokens!r}"
                                 + (f" ({type(drafter).__name__} reads the target's states of every step: it "
                                    f"cannot skip one)" if low else ""))
            return tuple(int(K) for K in table)
        self.profile = theory.resolve_profile(cost_profile, jax.default_backend())
        if self.profile is None:
            return (DEFAULT_K,) * self.slots
        return self._chosen(self.profile.acceptance, range(self.profile.max_k + 1))

    def _chosen(self, acceptance, among) -> tuple[int, ...]:
        """K by live rows among the Ks `among` (0: off, where it is among them), for drafts
        accepted at `acceptance` (per position): `theory.choose_slot_k` of each K's step at
        the width n live rows run in as the engine timed it (`step_ms`), else as the cost
        profile prices generate's step at batch n. A drafter that reads the target's states
        catches up only from the last pass's: it drafts every step."""
        def cost(n, K):
            if self.step_ms is not None:
                return self.step_ms[K][self._width(n)]
            return self.profile.cost(n, K) + self.profile.cost(n, 0) * (self.verify_cost(n, K) - 1.0)

        return tuple(max(theory.choose_slot_k(acceptance, {K: cost(n, K) for K in among}, n), self.least_k)
                     for n in range(1, self.slots + 1))

    def price(self, step_ms: dict, widths):
        """Takes the steps' costs the engine timed ({K: {width: ms}}; one (K, width) of
        `widths` missing: none are taken, the profile prices them all) and, for a table the
        profile chose, chooses again."""
        if all(w in step_ms.get(K, {}) for K in self._compiled for w in widths):
            self.step_ms = step_ms
            if self.profile is not None:
                self.table = self._chosen(self.acceptance(), self._compiled)

    def call_steps(self, n: int, K: int, most: int) -> int:
        """Steps of a call of n live rows at K: as many as last about CALL_MS at their timed
        costs, 1 to `most`; `most` where they were not timed."""
        ms = self.step_ms[K][self._width(n)] if self.step_ms is not None else None
        return most if not ms else max(1, min(most, round(CALL_MS / ms)))

    def acceptance(self) -> tuple[float, ...] | None:
        """P(draft position i accepted | the positions before it were), i = 1.., as the
        traffic so far shows it: of the drafts long enough to reach position i (at K >= i)
        that kept the positions before it, those that kept i too, where SEEN or more did;
        elsewhere the cost profile's figure (its own text's). Only with a profile."""
        if self.profile is None:
            return None
        out = []
        for i, prior in enumerate(self.profile.acceptance):
            deep = [K for K in self.drafted if K > i]
            reached = sum(self.accepted_at[K][i - 1] if i else self.drafted[K] for K in deep)
            out.append(sum(self.accepted_at[K][i] for K in deep) / reached if reached >= SEEN else prior)
        return tuple(out)

    def record(self, K: int, accepted: np.ndarray):
        """A call's drafted steps at K: accepted int [drafts], each one's drafted tokens the
        target accepted. Counts them, and re-chooses the table when it is due (`adapt`)."""
        self.drafts += accepted.size
        self.draft_tokens += accepted.size * K
        self.accepted += int(accepted.sum())
        self.drafted[K] += accepted.size
        for position in range(int(accepted.max(initial=0))):
            n = int((accepted > position).sum())
            self.accepted_per_position[position] += n
            self.accepted_at[K][position] += n
        self.adapt()

    def adapt(self):
        """Every ADAPT_DRAFTS drafted steps, K by live rows is chosen again from the steps'
        costs and the acceptance the traffic shows, among the Ks compiled: a workload
        drafted better than the profile's text speculates at more live rows, one drafted
        worse at fewer. Only a table the profile chose."""
        if self.profile is None or self.drafts < self._adapted + ADAPT_DRAFTS:
            return
        self._adapted = self.drafts
        self.table = self._chosen(self.acceptance(), self._compiled)
