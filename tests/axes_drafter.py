"""A drafter whose state is not rows first, for the tests of declared axes (test_sharding,
sharded_check): prompt lookup's drafts, and a state holding

- `table` int32 [T, 3]: shared by every row; T is the drafter's, chosen in the tests to
  equal the batch, so that a guess from shapes (a first dimension of B is rows) would
  split it over data, or cut it to a narrow run's rows (then `propose` raises);
- `seen` int32 [2, B]: its rows on axis 1: steps in which each row was live (both lines).
"""

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters import PromptLookup


@struct.dataclass
class TableState:
    table: jax.Array  # int32 [T, 3]: every row's (row_id + 1000 B at start: whose it was shows)
    seen: jax.Array  # int32 [2, B]: rows on axis 1

    AXES = {"table": (None, None), "seen": (None, "batch")}


@struct.dataclass
class Tabled(PromptLookup):
    table_rows: int = struct.field(pytree_node=False, default=4)

    def start(self, target, prompts, lengths, max_len, hidden=None):
        super().start(target, prompts, lengths, max_len, hidden)
        B = prompts.shape[0]
        table = jnp.arange(self.table_rows * 3, dtype=jnp.int32).reshape(self.table_rows, 3) + 1000 * B
        return TableState(table=table, seen=jnp.zeros((2, B), jnp.int32))

    def propose(self, state, request):
        if state.table.shape[0] != self.table_rows:
            raise AssertionError(f"the shared table was cut to {state.table.shape[0]} rows")
        _, cache, proposal = super().propose(None, request)
        seen = state.seen + (~request.done).astype(jnp.int32)[None]
        return state.replace(seen=seen), cache, proposal
