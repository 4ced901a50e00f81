"""Medusa heads (Cai et al., 2024): H heads on the target's last final hidden state, head
i guessing the token i+2 positions ahead, all at once, with no draft model and no cache.

Each head is a stack of residual blocks h + SiLU(W h + b) with its own weights per block,
read out through the target's own head (shared, never copied: trained heads stay a few
MB and follow the target's int8 or float weights), or through an output layer of its own
(FasterDecoding's Medusa-1 heads, read by formats.py: `{h}.{R}.weight`). The chain is each head's top-1; a
`specjax.Tree` takes the heads' top-k candidates per depth (deterministic siblings,
walked by the exact top-k acceptance rule).

The state the heads read is the target's hidden state at position length-2, which the
loop takes from the verification pass (`DraftRequest.features`): the target's own head on
it gave the last final token, the root. A row whose prompt is a single token has no such
state before its first pass, so nothing is drafted for it then.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters import trained
from specjax.drafters.base import DraftRequest, Drafter, grow, shape_for
from specjax.models import Model, head_logits
from specjax.tree import Tree


def heads_hidden(params: dict, h: jax.Array) -> jax.Array:
    """h [..., E] -> each head's state [..., H, E]. params: kernel [H, R, E, E], bias [H, R, E]."""
    kernel, bias = params["kernel"].astype(h.dtype), params["bias"].astype(h.dtype)
    x = jnp.broadcast_to(h[..., None, :], h.shape[:-1] + kernel.shape[:1] + h.shape[-1:])
    for r in range(kernel.shape[1]):
        x = x + jax.nn.silu(jnp.einsum("...he,hef->...hf", x, kernel[:, r]) + bias[:, r])
    return x


def heads_logits(params: dict, target: Model, h: jax.Array) -> jax.Array:
    """h [..., E] -> float32 logits [..., H, V]: head i's guess at the token i+2 ahead,
    read out by each head's own output layer where it has one (params' out {kernel [H, E,
    V]}: FasterDecoding's Medusa-1 heads), else by the target's head."""
    x = heads_hidden(params, h)
    if "out" in params:
        return jnp.einsum("...he,hev->...hv", x, params["out"]["kernel"].astype(x.dtype),
                          preferred_element_type=jnp.float32)
    return head_logits(target, x)


@struct.dataclass
class Medusa(Drafter):
    params: dict  # kernel float [H, R, E, E], bias [H, R, E]; optionally out {kernel [H, E, V]}
    signature: trained.TargetSignature = struct.field(pytree_node=False)
    tree: Tree | None = struct.field(pytree_node=False, default=None)  # None: a chain

    wants_features = True

    @classmethod
    def init(cls, target: Model, num_heads: int, key: jax.Array, tree: Tree | None = None,
             num_layers: int = 1) -> "Medusa":
        """Random heads: W ~ normal(0.02), b = 0, so each head starts near the target's own
        head on h (as Medusa's near-zero initialisation does); training starts from here."""
        if not (isinstance(num_heads, int) and num_heads >= 1 and isinstance(num_layers, int) and num_layers >= 1):
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 1, got {num_heads}, {num_layers}")
        E = target.config.hidden_size
        kernel = 0.02 * jax.random.normal(key, (num_heads, num_layers, E, E), jnp.float32)
        return cls({"kernel": kernel, "bias": jnp.zeros((num_heads, num_layers, E), jnp.float32)},
                   trained.TargetSignature.of(target), tree)

    @property
    def num_heads(self) -> int:
        return self.params["kernel"].shape[0]

    def resolve(self, K: int | None) -> "Medusa":
        if K is None and self.tree is None:  # its default chain: one draft per head
            K = self.num_heads
        tree = shape_for(self.tree, K, "top_k")
        if tree.depth > self.num_heads:
            raise ValueError(f"a Medusa of {self.num_heads} heads drafts at most {self.num_heads} "
                             f"deep; the {'chain' if tree.is_chain else 'tree'} asks for depth {tree.depth}")
        return self.replace(tree=tree)

    def bind(self, target: Model) -> "Medusa":
        """This drafter for target: refused unless it was made for its shape (a published
        head's record then takes the target's model_type and vocabulary size it lacked)."""
        self.signature.check(target, "Medusa")
        return self.replace(signature=trained.TargetSignature.of(target, self.signature.name))

    def start(self, target: Model, prompts, lengths, max_len, hidden=None):
        return None

    def propose(self, state, request: DraftRequest):
        f, length = request.features, request.length
        h = jnp.take_along_axis(f.hidden, jnp.clip(length - 2 - f.start, 0)[:, None, None], axis=1)[:, 0]
        logits = heads_logits(self.params, request.target, h)  # [B, H, V]

        def forward(cache, tokens, positions, placement=None, features=None):
            head = jnp.clip(positions - length[:, None] + 1, 0, self.num_heads - 1)  # the children's depth - 1
            return cache, jnp.take_along_axis(logits, head[..., None], axis=1), None

        _, proposal = grow(forward, None, logits[:, 0], length, request, self.tree)
        return state, request.target_cache, proposal.replace(valid=proposal.valid & (length >= 2)[:, None])

    def save(self, path):
        """Writes drafter.safetensors and drafter.json into the folder path."""
        return trained.save(path, "medusa", self.params, self.signature,
                            {"num_heads": self.num_heads, "num_layers": self.params["kernel"].shape[1]})

    @classmethod
    def from_record(cls, params, record, signature, tree, folder):
        from specjax.hf import CheckpointError

        H, R, E = record.get("num_heads"), record.get("num_layers"), signature.hidden_size
        if not (trained.positive_int(H) and trained.positive_int(R)):
            raise CheckpointError(f"{folder / trained.RECORD}: num_heads {H!r} and num_layers {R!r} must be "
                                  f"positive integers")
        want = {"kernel": (H, R, E, E), "bias": (H, R, E)}
        if "out" in params:  # an output layer per head (Medusa-1's)
            want["out"] = {"kernel": (H, E, signature.vocab_size)}
        got = jax.tree.map(lambda w: tuple(w.shape), params)
        if got != want:
            raise CheckpointError(f"{folder / trained.WEIGHTS}: Medusa weights {got} do not match the record's "
                                  f"shape {want}")
        return cls(params, signature, tree)
