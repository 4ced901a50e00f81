"""A paged engine's programs compiled for one v5e chip here (no TPU needed), for the source
tree first on sys.path: the call that steps the rows (K = 0 and 4, 8 slots of 256, pages of
16, a pool of 100) and the admission of the most tokens (`serve_plan`'s), at Llama shapes of
head_dim 128. Printed: temporaries and every copy over half a pool (a relayout of a cache or
a weight would show here).

    PYTHONPATH=<tree> python docs/bench/aot/engine_tpu_programs.py
"""

import dataclasses

from specjax.config import ModelConfig
from specjax.memory import MB
from specjax.tools import aot, serve_plan

CONFIG = dict(model_type="llama", vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=128, intermediate_size=512, max_position_embeddings=1024)


def main():
    config = ModelConfig.from_hf_config(CONFIG)
    target, draft = aot.abstract_model(config), aot.abstract_model(dataclasses.replace(config, num_layers=1))
    where = aot.on_device(aot.tpu_slice("v5e:1x1").devices[0])
    pool = 101 * 2 * 16 * 128  # elements of one pool [P, G, page, D]
    specs = [aot.engine_program(target, draft, where, slots=8, max_len=256, K=K, steps=2, kv_pages=100,
                                page_size=16) for K in (0, 4)]
    specs.append(serve_plan._largest_admission(target, draft, where, 8, 256, 16, 4))
    for spec in specs:
        program = aot.compile_spec(spec, copies_threshold=pool)
        print(f"{spec.name}: temporaries {program.temporaries / MB:.2f} MB, copies over half a pool: "
              f"{[str(c) for c in program.copies] or 'none'}", flush=True)


if __name__ == "__main__":
    main()
