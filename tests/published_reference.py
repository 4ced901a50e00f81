"""A published EAGLE-3 head's forward in torch, written from its authors' code, float32: the
reference tests/test_published.py checks specjax's `PublishedEagle3` against, and the
tensors each format names, for writing tiny heads as the formats' writers do.

Sources (read at these commits):
- SafeAILab/EAGLE cb7e084 eagle/model/cnets.py: `LlamaRMSNorm` (L370-384), `LlamaRotaryEmbedding`
  and `apply_rotary_pos_emb` (L110-190: rotate_half, base = config.rope_theta or 10000),
  `LlamaAttention` (L199-333: q/k/v over 2E, GQA by repeat_kv, softmax in float32), `LlamaMLP`,
  `LlamaDecoderLayeremb.forward` (L401-461: residual = the un-normed hidden, [input_layernorm
  (emb), hidden_norm(hidden)] concatenated embedding first), `Model.forward` (L586-663: fc on
  the target's 3 states only when their width is not E), `topK_genrate` (L700-755: logits =
  lm_head(norm(out)); target id = draft id + d2t[draft id]).
- speculators c05b95b models/eagle3/core.py L121-128 and L190-330: `input_norm` over the
  concatenated states (norm_before_fc), per-state `fc_norm`, `norm_before_residual`
  (residual = hidden_norm(hidden)), `norm_output` (the normed state read out and fed back).
- SpecForge a6b6b02 modeling/draft/llama3_eagle.py L1762-1772: per-state `fc_norm` before
  fc; `norm_output` false: lm_head reads the un-normed output.
"""

from __future__ import annotations

import torch


def rms_norm(x, w, eps):  # cnets.py L370-384: normalised in float32, cast back, then weighted
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(x, positions, base):  # x [T, heads, D]; cnets.py L110-190
    D = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    return x * cos + rotate_half(x) * sin


class Head:
    """A random head: w holds its tensors under EAGLE's names (midlayer.*), options as the
    writers name them."""

    def __init__(self, E, H, G, D, F, V, Vd, n=3, Et=None, seed=0, eps=1e-5, base=10000.0,
                 norm_before_residual=False, norm_output=False, out_norm=True, input_norm=False, fc_norm=False):
        g = torch.Generator().manual_seed(seed)
        Et = Et or E

        def r(*shape, std=0.2):
            return torch.randn(*shape, generator=g) * std

        def ones(n_):
            return 1 + r(n_, std=0.1)

        self.E, self.H, self.G, self.D, self.eps, self.base, self.n, self.Et = E, H, G, D, eps, base, n, Et
        self.options = dict(norm_before_residual=norm_before_residual, norm_output=norm_output, out_norm=out_norm)
        w = {"fc.weight": r(E, n * Et), "norm.weight": ones(E), "lm_head.weight": r(Vd, E),
             "midlayer.input_layernorm.weight": ones(E), "midlayer.hidden_norm.weight": ones(E),
             "midlayer.post_attention_layernorm.weight": ones(E),
             "midlayer.self_attn.q_proj.weight": r(H * D, 2 * E), "midlayer.self_attn.k_proj.weight": r(G * D, 2 * E),
             "midlayer.self_attn.v_proj.weight": r(G * D, 2 * E), "midlayer.self_attn.o_proj.weight": r(E, H * D),
             "midlayer.mlp.gate_proj.weight": r(F, E), "midlayer.mlp.up_proj.weight": r(F, E),
             "midlayer.mlp.down_proj.weight": r(E, F)}
        if input_norm:
            w["input_norm.weight"] = ones(n * Et)
        if fc_norm:
            w.update({f"fc_norm.{i}.weight": ones(Et) for i in range(n)})
        if Vd < V:  # the most frequent ids, sorted: d2t[i] = used[i] - i (traineagle3/cnets.py L673-676)
            used = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
            w["d2t"] = (used - torch.arange(Vd)).long()
            w["t2d"] = torch.zeros(V, dtype=torch.bool)
            w["t2d"][used] = True
        self.w = w

    def fuse(self, features):  # [T, n Et] -> [T, E]
        w = self.w
        if "input_norm.weight" in w:
            features = rms_norm(features, w["input_norm.weight"], self.eps)
        if "fc_norm.0.weight" in w:
            chunks = features.split(self.Et, dim=-1)
            features = torch.cat([rms_norm(c, w[f"fc_norm.{i}.weight"], self.eps) for i, c in enumerate(chunks)], -1)
        return features @ w["fc.weight"].T

    def forward(self, emb, hidden, positions):
        """emb [T, E] (token t+1's embedding), hidden [T, n Et] or [T, E], positions [T] ->
        (draft logits [T, Vd], the state fed back [T, E])."""
        w, E, H, G, D, eps = self.w, self.E, self.H, self.G, self.D, self.eps
        g = self.fuse(hidden) if hidden.shape[-1] != E else hidden
        e = rms_norm(emb, w["midlayer.input_layernorm.weight"], eps)
        h = rms_norm(g, w["midlayer.hidden_norm.weight"], eps)
        residual = h if self.options["norm_before_residual"] else g
        a = torch.cat([e, h], dim=-1)
        T = a.shape[0]
        q = (a @ w["midlayer.self_attn.q_proj.weight"].T).view(T, H, D)
        k = (a @ w["midlayer.self_attn.k_proj.weight"].T).view(T, G, D)
        v = (a @ w["midlayer.self_attn.v_proj.weight"].T).view(T, G, D)
        q, k = rope(q, positions, self.base), rope(k, positions, self.base)
        k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)  # repeat_kv
        scores = torch.einsum("thd,shd->hts", q, k) / D ** 0.5
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.einsum("hts,shd->thd", probs, v).reshape(T, H * D)
        x = residual + out @ w["midlayer.self_attn.o_proj.weight"].T
        m = rms_norm(x, w["midlayer.post_attention_layernorm.weight"], eps)
        x = x + (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T)
                 * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
        normed = rms_norm(x, w["norm.weight"], eps)
        if self.options["norm_output"]:  # speculators: the normed state read out and fed back
            return normed @ w["lm_head.weight"].T, normed
        readout = normed if self.options["out_norm"] else x
        return readout @ w["lm_head.weight"].T, x

    def target_ids(self, draft_ids):
        d2t = self.w.get("d2t")
        return draft_ids if d2t is None else draft_ids + d2t[draft_ids]

    def tensors(self, format: str) -> dict:
        """Its tensors under the format's names (speculators: layers.0.* for midlayer.*)."""
        if format != "speculators":
            return dict(self.w)
        return {k.replace("midlayer.", "layers.0."): v for k, v in self.w.items()}


def attention(x, w, prefix, H, G, D, positions, base):
    """EAGLE's LlamaAttention (cnets1.py / cnets.py L199-333) over x [T, in], causal."""
    T = x.shape[0]
    q = (x @ w[prefix + "q_proj.weight"].T).view(T, H, D)
    k = (x @ w[prefix + "k_proj.weight"].T).view(T, G, D)
    v = (x @ w[prefix + "v_proj.weight"].T).view(T, G, D)
    q, k = rope(q, positions, base), rope(k, positions, base)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / D ** 0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.einsum("hts,shd->thd", probs, v).reshape(T, H * D) @ w[prefix + "o_proj.weight"].T


class Eagle1Head:
    """EAGLE-1/2's head (SafeAILab/EAGLE cnets1.py L575-665, `LlamaDecoderLayer` L399-429):
    x = fc([embedding of token t+1, f_t]) + bias; layer 0 has no input norm; the output is
    read out by the target's lm_head, without a norm. Tensors as its files name them."""

    def __init__(self, E, H, G, D, F, V, seed=0, eps=1e-5, base=10000.0, bias=True, embedding=None):
        g = torch.Generator().manual_seed(seed)

        def r(*shape, std=0.2):
            return torch.randn(*shape, generator=g) * std

        self.E, self.H, self.G, self.D, self.eps, self.base = E, H, G, D, eps, base
        w = {"fc.weight": r(E, 2 * E), "layers.0.post_attention_layernorm.weight": 1 + r(E, std=0.1),
             "layers.0.self_attn.q_proj.weight": r(H * D, E), "layers.0.self_attn.k_proj.weight": r(G * D, E),
             "layers.0.self_attn.v_proj.weight": r(G * D, E), "layers.0.self_attn.o_proj.weight": r(E, H * D),
             "layers.0.mlp.gate_proj.weight": r(F, E), "layers.0.mlp.up_proj.weight": r(F, E),
             "layers.0.mlp.down_proj.weight": r(E, F)}
        if bias:
            w["fc.bias"] = r(E)
        if embedding is not None:  # its frozen copy of the target's (EAGLE-1 files carry one)
            w["embed_tokens.weight"] = embedding.clone()
        self.w = w

    def forward(self, emb, features, positions):
        """emb [T, E], features [T, E] (the target's final-normed states, or its own
        outputs) -> its outputs [T, E] (read out by the target's head)."""
        w = self.w
        x = torch.cat([emb, features], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        x = x + attention(x, w, "layers.0.self_attn.", self.H, self.G, self.D, positions, self.base)
        m = rms_norm(x, w["layers.0.post_attention_layernorm.weight"], self.eps)
        return x + (torch.nn.functional.silu(m @ w["layers.0.mlp.gate_proj.weight"].T)
                    * (m @ w["layers.0.mlp.up_proj.weight"].T)) @ w["layers.0.mlp.down_proj.weight"].T


class MedusaHeads:
    """FasterDecoding's Medusa heads (medusa_model.py e2a5d20 L58-72, L111-119): head k is R
    ResBlocks x + SiLU(linear(x)) over the target's final-normed state, then (Medusa-1) its
    own Linear(E, V, bias=False) `{k}.{R}`; tensors as medusa_lm_head names them."""

    def __init__(self, E, V, heads=3, blocks=1, own_out=True, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.heads, self.blocks = heads, blocks
        self.w = {}
        for h in range(heads):
            for b in range(blocks):
                self.w[f"{h}.{b}.linear.weight"] = torch.randn(E, E, generator=g) * 0.2
                self.w[f"{h}.{b}.linear.bias"] = torch.randn(E, generator=g) * 0.2
            if own_out:
                self.w[f"{h}.{blocks}.weight"] = torch.randn(V, E, generator=g) * 0.2

    def logits(self, state, lm_head):
        """state [..., E] -> [..., heads, V]: each head's logits (lm_head [V, E]: the
        target's, read where a head has none of its own)."""
        out = []
        for h in range(self.heads):
            x = state
            for b in range(self.blocks):
                w, bias = self.w[f"{h}.{b}.linear.weight"], self.w[f"{h}.{b}.linear.bias"]
                x = x + torch.nn.functional.silu(x @ w.T + bias)
            out.append(x @ self.w.get(f"{h}.{self.blocks}.weight", lm_head).T)
        return torch.stack(out, dim=-2)


def greedy_speculation(head: Head, target, embedding, prompt, K, max_new, taps):
    """EAGLE-3's greedy chain drafting (cnets.py `topK_genrate` with top_k 1) verified
    greedily by target (a transformers model), recomputed from scratch each step: the pairs
    (g_t, token t+1) of every final token carry the target's fused states at taps, the
    drafted ones the head's own output one position back. -> (the new tokens, the tokens
    each verification step emitted)."""
    seq, emitted = list(prompt), []
    with torch.no_grad():
        first = target(torch.tensor([seq])).logits[0, -1].argmax().item()  # the prefill's token
        seq.append(first)
        while len(seq) - len(prompt) < max_new:
            n = len(seq)
            states = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
            g = head.fuse(torch.cat([states[i][0] for i in taps], -1))[: n - 1]  # pairs t = 0..n-2
            tokens, drafts = list(seq[1:]), []
            for _ in range(K):
                T = g.shape[0]
                logits, out = head.forward(embedding[torch.tensor(tokens)], g, torch.arange(T))
                d = int(head.target_ids(logits[-1].argmax()))
                drafts.append(d)
                g = torch.cat([g, out[-1:]])  # the drafted pair: its own output at the position before
                tokens.append(d)
            verify = target(torch.tensor([seq + drafts])).logits[0, n - 1:].argmax(-1).tolist()  # [K+1]
            accepted = next((i for i, (d, v) in enumerate(zip(drafts, verify)) if d != v), K)
            new = (drafts[:accepted] + [verify[accepted]])[: max_new - (len(seq) - len(prompt))]
            seq += new
            emitted.append(len(new))
    return seq[len(prompt):], emitted
