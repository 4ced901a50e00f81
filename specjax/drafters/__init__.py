"""What proposes tokens. The decoding loop knows only this interface:

    state = drafter.init(prompts, lengths, max_len)            # once, before the loop
    state, drafts, q = drafter.propose(state, tokens, length, key, sampling, K)

`tokens` int32 [B, S] is the loop's token buffer and `length` int32 [B] how many of each
row's tokens are final: everything the drafter needs to know about what was accepted last
step. `drafts` int32 [B, K]; `q` [B, K, V_target]: the probabilities the drafts were drawn
from (warped like the target's; one-hot for a deterministic drafter). Drafters are pytrees
(flax struct dataclasses), so they pass through jit with the models they hold.
"""

from specjax.drafters.model import DraftModel

__all__ = ["DraftModel"]
