"""The engine's call compiled for one v5e chip, max_len-sized rows against pages (issue 58:
"a TPU-compiled paged step has no more temporaries than the dense one"): a tiny Llama of
head_dim 128 (tests/test_aot.py's paged case) with a one-layer draft, 4 slots of 256, K=0
and K=4, portable attention and the kernels; per program XLA's temporaries
(`memory_analysis()`) and its weight- or cache-sized copies (aot.py's instrument).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python docs/bench/paged_aot.py > docs/bench/paged_aot.txt
"""

import dataclasses
import subprocess

from specjax.config import ModelConfig
from specjax.tools import aot
from tests.test_aot import TINY


def main():
    config = ModelConfig.from_hf_config(dict(TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                             hidden_size=256, max_position_embeddings=1024))
    target, draft = aot.abstract_model(config), aot.abstract_model(dataclasses.replace(config, num_layers=1))
    where = aot.on_device(aot.tpu_slice("v5e:1x1").devices[0])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# docs/bench/paged_aot.py at {head}: v5e:1x1, 4 slots of max_len 256, pages of 16 (100 + the null page)")
    print(f"{'attention':<10} {'K':>2} {'cache':<6} {'temporaries':>12}  large copies")
    for attention in ("portable", "kernels"):
        for K in (0, 4):
            for pages in (None, 100):
                spec = aot.engine_program(target.replace(attention=attention), draft.replace(attention=attention),
                                          where, slots=4, max_len=256, K=K, steps=2, kv_pages=pages, page_size=16)
                program = aot.compile_spec(spec)
                print(f"{attention:<10} {K:>2} {'dense' if pages is None else 'paged':<6} {program.temporaries:>12,}  "
                      f"{'; '.join(map(str, program.copies)) or 'none'}", flush=True)


if __name__ == "__main__":
    main()
