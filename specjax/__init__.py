"""specjax: speculative decoding for JAX/Flax programs.

The public API, re-exports only (and transformers' advisory about torch silenced: quiet.py).
"""

import specjax.quiet  # noqa: F401 -- first, before anything imports transformers
from specjax.cache import KVCache
from specjax.drafters import (Datastore, Drafter, DraftModel, Eagle, Eagle3, EarlyExit, Lookahead, Medusa, Mtp,
                              PromptLookup, PublishedEagle, PublishedEagle3, Retrieval,
                              load_drafter)
from specjax.drafters.vocab import draft_vocabulary
from specjax.generate import GenerateOutput, Stats, compile_generate, estimate_memory, generate, pad_prompts
from specjax.grammar import Grammar, GrammarError, Vocabulary
from specjax.config import GenerationConfig, ModelConfig
from specjax.hf_config import InvalidConfigError, UnsupportedConfigError
from specjax.folders import CheckpointError, UnsafeCheckpointError
from specjax.hf import load_model, save_model
from specjax.text import load_tokenizer
from specjax.budget import MemoryEstimate
from specjax.memory import InsufficientMemoryError
from specjax.models import Model, forward
from specjax.quant import Int8, quantize
from specjax.serve import Engine, Request
from specjax.shipped import shipped_checkpoint
from specjax.sharding import gather, make_mesh, shard_model
from specjax.theory import CostProfile
from specjax.tree import Tree
from specjax.version import __version__

__all__ = [
    "CheckpointError", "CostProfile", "Datastore", "DraftModel", "Drafter", "Eagle", "Eagle3", "EarlyExit", "Engine",
    "GenerateOutput", "GenerationConfig", "Grammar", "GrammarError", "InsufficientMemoryError", "InvalidConfigError", "Int8", "KVCache",
    "Lookahead", "Medusa", "MemoryEstimate", "Model", "Mtp", "ModelConfig", "PromptLookup", "PublishedEagle", "PublishedEagle3",
    "Request", "Retrieval", "Stats",
    "Tree", "UnsafeCheckpointError", "UnsupportedConfigError", "Vocabulary", "__version__", "compile_generate", "draft_vocabulary",
    "estimate_memory", "forward", "gather", "generate", "load_drafter", "load_model", "load_tokenizer", "make_mesh",
    "pad_prompts", "quantize", "save_model", "shard_model", "shipped_checkpoint",
]
