"""specjax: speculative decoding for JAX/Flax programs.

The public API, re-exports only.
"""

from specjax.cache import KVCache
from specjax.drafters import DraftModel, EarlyExit, PromptLookup
from specjax.generate import GenerateOutput, Stats, compile_generate, generate, pad_prompts
from specjax.config import GenerationConfig, InvalidConfigError, ModelConfig, UnsupportedConfigError
from specjax.hf import CheckpointError, UnsafeCheckpointError, load_model, load_tokenizer, save_model
from specjax.models import Model, forward
from specjax.sharding import make_mesh, shard_model

__all__ = [
    "CheckpointError", "DraftModel", "EarlyExit", "PromptLookup", "GenerateOutput", "GenerationConfig",
    "InvalidConfigError", "KVCache", "Model", "ModelConfig", "UnsafeCheckpointError", "compile_generate",
    "Stats", "UnsupportedConfigError", "forward", "generate", "load_model", "load_tokenizer",
    "make_mesh", "pad_prompts", "save_model", "shard_model",
]
