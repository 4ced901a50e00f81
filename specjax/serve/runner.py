"""`Runner`: the engine's device state and the only code that changes it.

It holds the `SlotState` the programs (programs.py) step, the page table it last sent to
the device, and whether the draft's state lags its rows (calls at K = 0); it applies a
turn's work (scheduler.py's `Turn`) one device call at a time. Its contract: before every
call that steps rows (`run`, the draft's `sync`), the device's page table is the host's
(sent where it differs from the one last sent; an admission sends the whole table too);
a row that is done as a call starts writes only to the null page (programs.py). With
`check` on (the tests), every run reads the device's table and rows back and asserts both.

It knows the programs and a request's fields (its context, settings, seed); nothing of
queues, pages' owners or threads (scheduler.py, engine.py).
"""

from __future__ import annotations

import numpy as np

from specjax import loop
from specjax.serve.programs import Emitted, Programs
from specjax.serve.scoring import prompt_logprobs


class Runner:
    """One engine's device state over `programs`. `state` is None until `reset`."""

    def __init__(self, programs: Programs):
        self.programs = programs
        self.state = None
        self.sent: np.ndarray | None = None  # int32 [slots, M]: the table the device's state holds (paged)
        self.draft_behind = False  # a call ran at K = 0 since the draft's state last caught up
        self.syncs = 0  # catch-ups of the draft's state after such calls
        self.check = False  # read the device's table and rows back before each run, and assert the contract

    @property
    def paged(self) -> bool:
        return self.programs.paging is not None

    def reset(self):
        """A fresh state: every row done and free, every table entry the null page. If it
        cannot be made, `state` stays None (and this raises)."""
        self.state, self.draft_behind = None, False
        self.state = self.programs.empty()
        self.sent = np.zeros((self.programs.slots, self.programs.table_width), np.int32) if self.paged else None

    def stop(self, slots):
        """Rows `slots` stop: marked done (a cancelled or preempted request's)."""
        if slots:
            self.state = self.programs.release(self.state, slots)

    def send_table(self, table: np.ndarray | None):
        """The device's page table made `table` (the host's): a call only where it differs."""
        if table is None or np.array_equal(table, self.sent):
            return
        self.state = self.programs.set_table(self.state, table)
        self.sent = np.array(table, np.int32)

    def prefill(self, requests):
        """Unpaged: the rows of `requests` prefilled together (a device call that leaves the
        state alone: a failure here is theirs, not the state's)."""
        return self.programs.prefill(*self._arguments(requests))

    def insert(self, slots, rows):
        """`prefill`'s rows placed in the state's rows `slots`."""
        self.state = self.programs.insert(self.state, list(slots), rows)

    def admit(self, slots, requests, table: np.ndarray):
        """Paged: `requests` prefilled from each one's `prefilled` on straight into their pages
        and placed in rows `slots`; the device's table becomes `table` (the host's)."""
        contexts, limits, samplings, stops, seeds, outputs, grammars = self._arguments(requests)
        self.state = self.programs.admit(self.state, list(slots), contexts, [r.prefilled for r in requests], limits,
                                         samplings, stops, seeds, table, outputs, grammars)
        self.sent = np.array(table, np.int32)

    def _arguments(self, requests) -> tuple:
        """(`Programs.prefill`'s arguments) for these requests, each from its whole context."""
        stops = np.full((len(requests), self.programs.stop_width), -1, np.int32)
        for i, request in enumerate(requests):
            stops[i, :len(request.stop_token_ids)] = request.stop_token_ids
        return ([np.asarray(r.context, np.int32) for r in requests],
                [len(r.prompt) + r.max_new_tokens for r in requests], [r.sampling for r in requests], stops,
                [r.seed for r in requests], [len(r.prompt) for r in requests],  # where each output begins
                [(r.grammar, r.tokens) for r in requests])

    def prefill_chunk(self, slot: int, request, start: int, table: np.ndarray):
        """Positions start .. start + chunk - 1 of a long prompt written into its row's pages
        (`table`: the host's, its row's included); its row is not placed."""
        self.state = self.programs.prefill_chunk(self.state, slot, request.context, start, table)

    def run(self, live, K: int, kind: str, steps: int, logprobs: bool, table: np.ndarray | None) -> Emitted:
        """The live rows (slots `live`) stepped one call at K (`Programs.run`), the device's
        table the host's first, and the draft's state caught up first where calls at K = 0
        left it behind."""
        self.send_table(table)
        if self.check:
            self._check(live, table)
        if K and self.draft_behind:  # the steps at K hold one window of catch-up: feed what K = 0 left
            self.state = self.programs.sync(self.state, K)
            self.syncs += 1
        self.draft_behind = K == 0 and self.programs.deepest is not None
        self.state, emitted = self.programs.run(self.state, K, max(live) + 1, kind, steps, logprobs=logprobs)
        return emitted

    def _check(self, live, table):
        """Asserts the contract: the device's table is the host's; a row not live is done."""
        if table is not None:
            device = np.asarray(loop.page_table(self.state))
            assert np.array_equal(device, table), f"the device's page table differs from the host's:\n{device}\n{table}"
        done = np.asarray(self.state.done)
        assert all(done[slot] for slot in range(len(done)) if slot not in live), (done, sorted(live))

    def score(self, prompt, top: int) -> tuple:
        """A prompt's own log-probabilities (`scoring.prompt_logprobs`): a pass of its own over
        the prompt's bucket, which leaves the state alone."""
        return prompt_logprobs(self.programs, prompt, top)

    def catch_up(self, tokens, held: int, pages) -> int:
        """A finished row's draft model made to hold what its target's cache holds, where calls
        at K = 0 left it behind (`Programs.catch_up`) -> the positions below which every cache
        of the row now holds its entries."""
        self.state, held = self.programs.catch_up(self.state, tokens, held, pages)
        return held
