"""The 1b pair's one-token pass, traced for CUDA: its lowering's bytes accessed over what it must
read (aot.py's cuda/ideal column for that row), for the checkout at ROOT. Used to bisect that
column across commits (docs/bench/aot.txt):

    for c in COMMITS; do git worktree add /tmp/c_$c $c; PYTHONPATH=/tmp/c_$c JAX_PLATFORMS=cpu \
        ALLOW_MULTIPLE_LIBTPU_LOAD=1 python docs/bench/cuda_ratio.py /tmp/c_$c; done
"""

import sys

root = sys.argv[1]
sys.path[:0] = [root, root + "/docs/bench"]

from aot import pair  # noqa: E402  (ROOT's docs/bench/aot.py)
from specjax.tools import aot  # noqa: E402

target, _ = pair("1b", None)
spec = aot.pass_program(target, aot.on_device(aot.tpu_slice("v5e:1x1").devices[0]), batch=1, context=512, tokens=1)
print(root, aot.cuda_bytes(spec) / spec.must_read)
