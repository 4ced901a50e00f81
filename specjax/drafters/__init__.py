"""What proposes tokens. The decoding loop knows drafters only through this interface:

    state = drafter.init(target, prompts, lengths, max_len)     # once, before the loop
    state, target_cache, proposal = drafter.propose(state, request)

`request` (a `DraftRequest`) carries the loop's token buffer and each row's count of final
tokens — everything a drafter needs to know about what was accepted last step — plus the
target and its cache (which a drafter that shares the target's weights may write into and
must hand back), the key, the sampling parameters, K, and how many tokens each row may
draft. A `Proposal` holds the drafts, the probabilities q they were drawn from (warped
like the target's; one-hot for a deterministic drafter) and how many each row proposed.
Drafters are pytrees (flax struct dataclasses), so they pass through jit with what they hold.
"""

from specjax.drafters.base import DraftRequest, Proposal
from specjax.drafters.early_exit import EarlyExit
from specjax.drafters.model import DraftModel
from specjax.drafters.prompt_lookup import PromptLookup

__all__ = ["DraftModel", "DraftRequest", "EarlyExit", "PromptLookup", "Proposal"]
