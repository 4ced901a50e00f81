"""How an admission's and an insert's programs grow with their group: the updates
(dynamic_update_slice and scatter ops) in the lowered HLO of a paged admission, and of an
unpaged insert in both forms (one scatter a leaf; one update a row, a TPU's), for 8 and 64
rows, on tests/tiny.py's Llama at 64 slots. Lowered only, nothing compiled.

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD python docs/bench/admission_size.py
"""

import tempfile

import jax
import numpy as np

import specjax
from specjax.serve.programs import insert_rows
from tests import tiny


def count(lowered) -> int:
    text = lowered.as_text()
    return text.count("dynamic_update_slice") + text.count("scatter")


def main():
    folder = tempfile.mkdtemp()
    tiny.build("llama").save_pretrained(folder)
    target = specjax.load_model(folder)
    paged = specjax.Engine(target, slots=64, max_len=64, kv_pages=130, page_size=8).programs
    dense = specjax.Engine(target, slots=64, max_len=64).programs

    def insert(n, unrolled):
        rows = jax.eval_shape(lambda: dense.prefill(*dense.dummy_prompts(n, 16)))
        return count(insert_rows.lower(dense.state_shapes(), jax.ShapeDtypeStruct((n,), np.int32), rows,
                                       dense.deepest, None, mesh=None, rules=None, unrolled=unrolled))

    for n in (8, 64):
        print(f"{n} rows: paged admission {count(paged.lower_admission(paged.state_shapes(), n, 16)[0])} updates; "
              f"unpaged insert {insert(n, False)} (one scatter a leaf), {insert(n, True)} (one update a row)")


if __name__ == "__main__":
    main()
