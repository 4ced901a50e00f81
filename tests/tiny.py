"""Tiny random transformers models for parity tests: no downloads, weights large enough
(std 0.15+) that logits are far from uniform and a wrong mapping shows."""

import torch
import transformers as tr

VOCAB = 97

CONFIGS = {
    # GPT-2: learned positions, LayerNorm with bias, fused c_attn, tied head.
    "gpt2": lambda: tr.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0),
    # GPT-2 with an untied head and an explicit MLP width.
    "gpt2_untied": lambda: tr.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_inner=40,
                                         n_positions=64, tie_word_embeddings=False,
                                         bos_token_id=0, eos_token_id=0),
    # Llama: GQA (4 query heads over 2 kv heads), explicit head_dim != E/H, untied head.
    "llama": lambda: tr.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    intermediate_size=48, max_position_embeddings=128,
                                    bos_token_id=0, eos_token_id=1, pad_token_id=None),
    # Llama-3 rope scaling, tied head, attention and MLP biases, a legacy top-level rope_theta.
    "llama3": lambda: tr.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1,
                                     intermediate_size=48, max_position_embeddings=128,
                                     tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16},
                                     rope_theta=500.0, bos_token_id=0, eos_token_id=1),
    # YaRN rope over an original length of 8 (the tests' sequences run past it), its ramp
    # spanning a few of the 8 frequencies (beta_fast 4, beta_slow 0.25, base 100), truncated,
    # and the attention factor scaling cos and sin derived from the factor.
    "llama_yarn": lambda: tr.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         intermediate_size=48, max_position_embeddings=32,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                                                          "original_max_position_embeddings": 8,
                                                          "beta_fast": 4.0, "beta_slow": 0.25},
                                         bos_token_id=0, eos_token_id=1),
    # Mistral: GQA down to one kv head, a sliding window shorter than the test sequences.
    "mistral": lambda: tr.MistralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1,
                                        intermediate_size=48, sliding_window=5,
                                        max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
    # Qwen2: q/k/v biases, tied head.
    "qwen2": lambda: tr.Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=48, tie_word_embeddings=True,
                                    max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
    # Qwen2 with sliding-window attention on its upper layers only (per-layer windows).
    "qwen2_sliding": lambda: tr.Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            intermediate_size=48, use_sliding_window=True,
                                            sliding_window=4, max_window_layers=1,
                                            max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
    # Gemma 2: sliding (window 5) and global layers alternating, both soft-caps low enough
    # to bend, query_pre_attn_scalar != head_dim, tied head.
    "gemma2": lambda: tr.Gemma2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      intermediate_size=48, query_pre_attn_scalar=24,
                                      sliding_window=5, attn_logit_softcapping=3.0,
                                      final_logit_softcapping=6.0, max_position_embeddings=128,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=0),
    # Gemma 3 text: q/k norms, local and global rope bases (linear scaling on the global
    # layers only), an explicit layer pattern with a window of 4.
    "gemma3": lambda: tr.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, intermediate_size=48, query_pre_attn_scalar=16,
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}},
        max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=0),
    # Qwen3: q/k norms, head_dim 16 != E/H, untied head.
    "qwen3": lambda: tr.Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    intermediate_size=48, max_position_embeddings=128,
                                    bos_token_id=0, eos_token_id=1),
    # Qwen3 with a tied head, attention biases and sliding windows on its upper layers.
    "qwen3_tied": lambda: tr.Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         intermediate_size=48, tie_word_embeddings=True,
                                         attention_bias=True, use_sliding_window=True,
                                         sliding_window=4, max_window_layers=1,
                                         max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
    # Phi-3: fused qkv_proj and gate_up_proj, plain rope, a window of 6 on every layer.
    "phi3": lambda: tr.Phi3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                  sliding_window=6, max_position_embeddings=128,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=None),
    # Qwen3-MoE: 8 experts, top 2 renormalised, q/k norms, a dense middle layer (mlp_only_layers).
    "qwen3_moe": lambda: tr.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           intermediate_size=40, moe_intermediate_size=16, num_experts=8,
                                           num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                           max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
    # Qwen2-MoE: top 3 of 6 unnormalised, a gated shared expert, q/k/v biases, tied head.
    "qwen2_moe": lambda: tr.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                                           moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                           num_experts=6, num_experts_per_tok=3, tie_word_embeddings=True,
                                           max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
    # Mixtral: top 2 of 4, a sliding window of 5 on every layer.
    "mixtral": lambda: tr.MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, intermediate_size=16,
                                        num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                                        max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
    # gpt-oss: sliding (window 4) and full layers alternating, attention sinks, q/k/v/o biases,
    # yarn rope (truncate false) past an original length of 8, 4 experts (top 2 of the router's
    # biased logits, softmaxed), fused and interleaved gate/up with biases, a clamp limit low
    # enough to bite.
    "gpt_oss": lambda: tr.GptOssConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=4, swiglu_limit=0.8, max_position_embeddings=32,
                                       rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                                                        "original_max_position_embeddings": 8, "beta_fast": 4.0,
                                                        "beta_slow": 0.25, "truncate": False},
                                       bos_token_id=0, eos_token_id=1, pad_token_id=0),
    # DeepSeek-V3, every layer dense: latent attention with a low-rank query (q_a_proj, its
    # norm, q_b_proj), interleaved rope lanes, a latent of 16 + 8 numbers a token.
    "deepseek_v3": lambda: tr.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=3, num_nextn_predict_layers=0, n_routed_experts=4, n_group=1, topk_group=1,
        num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=1),
    # DeepSeek-V3 with one q_proj (q_lora_rank null), rope lanes in halves, v_head_dim != nope,
    # a tied head.
    "deepseek_v3_q": lambda: tr.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
        v_head_dim=10,
        rope_interleave=False, first_k_dense_replace=2, num_nextn_predict_layers=0, n_routed_experts=4,
        n_group=1, topk_group=1, num_experts_per_tok=2, moe_intermediate_size=16, tie_word_embeddings=True,
        max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
    # DeepSeek-V3 with experts from its second layer on: 8 routed experts in 4 groups, a token's
    # 3 from its 2 best groups (by a router bias, e_score_correction_bias), a shared expert,
    # weights renormalised and scaled by 2.5; yarn rope with mscales (cos, sin and the softmax scale).
    "deepseek_v3_moe": lambda: tr.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, first_k_dense_replace=1, num_nextn_predict_layers=0, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=16, norm_topk_prob=True,
        routed_scaling_factor=2.5, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 8,
                         "beta_fast": 4.0, "beta_slow": 0.25, "mscale": 1.0, "mscale_all_dim": 0.8}),
    # GLM-4.5 (glm4_moe): GQA (4 heads over 2) with q/k/v biases and q/k norms, rotary over half
    # of each 16-lane head; a dense first layer, then DeepSeek-V3's experts: 8 in 4 groups, a
    # token's 3 from its 2 best groups (by e_score_correction_bias), a shared expert, weights
    # renormalised and scaled by 2.5.
    "glm4_moe": lambda: tr.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
        first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
        n_shared_experts=1, moe_intermediate_size=16, norm_topk_prob=True, routed_scaling_factor=2.5,
        num_nextn_predict_layers=0, max_position_embeddings=128, bos_token_id=0, eos_token_id=1),
}
CLASSES = {"deepseek_v3": tr.DeepseekV3ForCausalLM, "glm4_moe": tr.Glm4MoeForCausalLM, "deepseek_v3_q": tr.DeepseekV3ForCausalLM,
           "deepseek_v3_moe": tr.DeepseekV3ForCausalLM,
           "gpt2": tr.GPT2LMHeadModel, "gpt2_untied": tr.GPT2LMHeadModel,
           "llama": tr.LlamaForCausalLM, "llama3": tr.LlamaForCausalLM, "llama_yarn": tr.LlamaForCausalLM,
           "mistral": tr.MistralForCausalLM, "qwen2": tr.Qwen2ForCausalLM,
           "qwen2_sliding": tr.Qwen2ForCausalLM, "gemma2": tr.Gemma2ForCausalLM,
           "gemma3": tr.Gemma3ForCausalLM, "qwen3": tr.Qwen3ForCausalLM,
           "qwen3_tied": tr.Qwen3ForCausalLM, "phi3": tr.Phi3ForCausalLM,
           "qwen3_moe": tr.Qwen3MoeForCausalLM, "qwen2_moe": tr.Qwen2MoeForCausalLM,
           "mixtral": tr.MixtralForCausalLM, "gpt_oss": tr.GptOssForCausalLM}
# Mixtures of experts (models/moe.py), each checked against transformers.
MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral"]
# The families added with Gemma, Qwen3 and Phi-3 (each checked end to end, with int8 too).
NEW_FAMILIES = ["gemma2", "gemma3", "qwen3", "qwen3_tied", "phi3"]


def build(name: str, seed: int = 0, std: float = 0.15):
    """A random float32 transformers model with weights ~ N(0, std) and norms that scale by
    1 + N(0, std) (Gemma's norms scale by 1 + w, so there w ~ N(0, std))."""
    torch.manual_seed(seed)
    return randomized(CLASSES[name](CONFIGS[name]()).eval(), std)


def randomized(model, std: float = 0.15):
    """model with its weights drawn as `build` draws them (from torch's current seed)."""
    offset = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(0.0, std)
            if "norm" in pname or ".ln_" in pname:
                if pname.endswith("weight"):
                    p.add_(offset)
            if pname.endswith(".sinks"):  # attention sinks (gpt-oss) of magnitude ~1.5: they matter
                p.mul_(10.0)
        for bname, b in model.named_buffers():  # DeepSeek-V3's router bias: a buffer, saved
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, std)
    return model


def logits(model, tokens):
    """transformers' float32 logits of an int array [B, T], no padding."""
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


def transformers_greedy(model, prompt, max_new_tokens, eos=None):
    """transformers' greedy continuation of one unpadded prompt (new tokens only)."""
    model.generation_config.eos_token_id = eos
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0, eos_token_id=eos)
    return out[0, len(prompt):].numpy().tolist()


def rows(out):
    """A GenerateOutput's rows as lists of their generated tokens."""
    return [out.tokens[b, : out.num_tokens[b]].tolist() for b in range(out.tokens.shape[0])]


def noisy(model, std, seed):
    """A specjax Model with Gaussian noise added to every weight: a draft that agrees with
    the original more or less often."""
    import jax
    import numpy as np

    import specjax

    rng = np.random.RandomState(seed)
    params = jax.tree.map(lambda x: x + std * rng.randn(*x.shape).astype(np.float32), model.params)
    return specjax.Model(model.config, params)


def save_tokenizer(folder, corpus, vocab_size=90, chat_template=None):
    """A small BPE tokenizer (fits VOCAB) that adds BOS like Llama's, saved into folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size,
                                                        special_tokens=["<unk>", "<s>", "</s>"]))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = tr.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return fast


def own_text(model, rows: int = 40, new_tokens: int = 40):
    """A model's own greedy text from random two-token prompts, for training a drafter on it:
    (stream [32 (2 + new_tokens)], held-out [(rows - 32) (2 + new_tokens)]), rows 0..31 and the rest."""
    import numpy as np

    import specjax

    prompts = np.random.RandomState(0).randint(2, VOCAB, (rows, 2)).astype(np.int32)
    out = specjax.generate(model, prompts, np.full(rows, 2, np.int32), max_new_tokens=new_tokens)
    text = np.concatenate([prompts, np.asarray(out.tokens)], axis=1)
    return text[:32].reshape(-1), text[32:].reshape(-1)
