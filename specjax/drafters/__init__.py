"""What proposes tokens. The decoding loop knows drafters only through `Drafter`
(base.py), which every drafter subclasses; its defaults are what a drafter needing nothing
more gets:

    drafter = drafter.resolve(K)      # its shape: its own tree, or a chain of K (static)
    drafter.tree, drafter.target_room # N nodes, depth; slots it writes past the target's root
    drafter = drafter.bind(target)    # checks (and adapts to) the target: vocabulary, sizes
    drafter.check_lengths(longest, max_new_tokens)  # its own model's position limit
    state = drafter.start(target, prompts, lengths, max_len, hidden=None)  # once, before the loop
        # (drafters with wants_features = True get hidden=: the prefill's states [B, P, E],
        #  and each request carries `Features`: the verification pass's states of what it kept)
    state, target_cache, proposal = drafter.propose(state, request)
    state = drafter.observe(state, logits, active)  # only if the proposal carried a `Branch`
    drafter.state_rules(rules)        # how its state lies on a mesh
    drafter.state_axes(state)         # its state's logical axes: where its rows are ("batch")
    drafter.fixed_shape               # True: num_draft_tokens="auto" may not choose its shape

`request` (a `DraftRequest`) carries the loop's token buffer and each row's count of final
tokens — everything a drafter needs to know about what was accepted last step — plus
which rows are done, the target and its cache (which a drafter that shares the target's
weights may write into and must hand back), the key, the sampling parameters, and how deep
each row may draft. A `Proposal` is a token tree per row: the tokens, each node's parent
(numpy for a fixed shape), which nodes were proposed, and the distributions q they were
drawn from — or None when the drafter is deterministic (one-hot q, never materialised) —
and, optionally, a `Branch`: extra tokens the target scores in the same pass under the
drafter's own mask, whose logits the drafter then observes (lookahead's Jacobi window).
Drafters are pytrees (flax struct dataclasses), so they pass through jit with what they hold.

A drafter's state declares each array's logical axes (`state_axes`; by default an AXES table
on the state's class, next to its fields: every field must be named), never guessed from
shapes: rows ("batch") are split over a mesh's data axis and written per row when the
engine (specjax/serve) inserts a freshly prefilled row (a shorter array, e.g. a cache
started at a prompt's bucket, at its start); an array with no "batch" is shared by all
rows. The states here have their rows first. A drafter keeps, per row, what it has seen (a
model drafter: its cache's `lengths`), and catches up from there, so its next proposal is
right after a step at another K, a step in which it did not draft, or in a slot just
refilled. Drafters that read the target's states (`wants_features`) catch up only from the
last pass's, so the engine lets them draft every step.
"""

from specjax.drafters.base import Branch, Drafter, DraftRequest, Features, Proposal
from specjax.drafters.eagle import Eagle
from specjax.drafters.eagle3 import Eagle3
from specjax.drafters.early_exit import EarlyExit
from specjax.drafters.lookahead import Lookahead
from specjax.drafters.medusa import Medusa
from specjax.drafters.model import DraftModel
from specjax.drafters.mtp import Mtp
from specjax.drafters.prompt_lookup import PromptLookup
from specjax.drafters.published import PublishedEagle, PublishedEagle3
from specjax.drafters.retrieval import Datastore, Retrieval
from specjax.drafters.load import load_drafter

__all__ = ["Branch", "Datastore", "Drafter", "DraftModel", "DraftRequest", "Eagle", "Eagle3", "EarlyExit",
           "Features", "Lookahead", "Medusa", "Mtp", "PromptLookup", "Proposal", "PublishedEagle", "PublishedEagle3",
           "Retrieval", "load_drafter"]
