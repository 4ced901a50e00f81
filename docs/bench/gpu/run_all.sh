#!/usr/bin/env bash
# Every GPU measurement of docs/bench/gpu/README.md ("Commands") plus `specjax bench --profile`,
# one after the other, in at most $BUDGET seconds (default 540: the GPU machine kills a command
# at 10 minutes). Run from anywhere in the repository:
#
#   bash docs/bench/gpu/run_all.sh                 # on the GPU, writes to $OUT (default /tmp/gpu-run)
#   bash docs/bench/gpu/run_all.sh synth-8b-notriton gemv-8b   # only the steps named
#   JAX_PLATFORMS=cpu bash docs/bench/gpu/run_all.sh --smoke    # (or SMOKE=1) tiny sizes, on CPU
#   bash docs/bench/gpu/run_all.sh --list          # the steps, in the order they run
#
# Writes under $OUT: NN-STEP.log (each step's stdout and stderr), gpubench's JSON
# (gpubench-PART-SIZE-DTYPE.json; the XLA_FLAGS steps' under $OUT/xla-notriton/), profile.json
# (bench --profile), and run_all.log: each step's command, exit status and seconds, and last a
# summary (passed / failed / timed out / skipped).
#
# Time: each step has its own `timeout` (its cap below, cut to what is left of the budget; a
# step with less than MIN_STEP seconds left is skipped, not started). A timed-out step gets
# SIGTERM, which the wrapper turns into SystemExit so that gpubench still writes the JSON of
# what it measured (its `finally`), then SIGKILL 15 s later. Steps run in order of value: what
# no GPU run has measured yet first (bench --profile: a GPU cost profile; parts: where a pass's
# time goes, for the verification pass at batch 8 that README.md's "After" leaves unexplained;
# selfdraft), then what the H200 run at 975b50f measured (attention portable vs kernels,
# synth 1b --hf, synth 8b, shipped), then the XLA_FLAGS variants, then gemv.py (standalone: it
# measures no specjax code, and its default-flag numbers exist from "Before").
# Last, everything under $OUT is also packed into $OUT/00-all.tgz (the name sorts first: the
# device tool brings back a limited number of files).
#
# Reduced from README.md's commands to fit 9 minutes (caps and sizes are estimates: no GPU was
# available to write this; a GPU compile of the 8B pair's programs takes on the order of a
# minute, and every K, batch size, --pass-tokens value and tree is a program of its own):
#   synth 1b --hf:  --ks 5 7 (not 3 5 7), --pass-tokens 1 8 32 (not 1 2 4 ... 64), --max-new 128 (not 256)
#   synth 8b:       --ks 5 (not 5 7), --batches 1 (not 1 8), --pass-tokens 1 8, --max-new 64
#   synth 1b, triton gemm off: no --tree/--hf (as README), --ks 5, --pass-tokens 1 8 32, --max-new 128
#   bench --profile: -k 6 (not 8), --tree-nodes 4 8 12 (not 2 4 6 8 12), --repeats 3
#                    (specjax/profiles/cpu.json was measured with -k 8 ... --repeats 5)
#   gemv.py, default flags: python,separate,fused (not all six kinds; the stacked scan,
#                    scan_unroll and fori_dynamic loops were measured "Before" and gemv.py is unchanged)
#   shipped, selfdraft, parts.py, gemv.py with triton gemm off: as README.md has them.
# Steps left out by the budget are listed as skipped; run them by name in a second call.
#
# Python: $PYTHON (default python) with jax etc. importable; specjax runs from this checkout
# (PYTHONPATH=$PWD, `python -m specjax.cli`), it need not be installed. XLA_FLAGS is cleared
# for the default-flag steps. JAX's persistent compilation cache ($JAX_COMPILATION_CACHE_DIR,
# default /tmp/specjax-jax-cache; not under $OUT) lets parts.py and selfdraft reuse programs
# that synth and shipped compiled (same shapes, same flags); it changes no timing measured.
set -u

cd "$(dirname "${BASH_SOURCE[0]}")/../../.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python}
SMOKE=${SMOKE:-0}
LIST=0
ONLY=()
for a in "$@"; do
  case "$a" in
    --smoke) SMOKE=1 ;;
    --list) LIST=1 ;;
    -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "run_all.sh: unknown option $a (see --help)" >&2; exit 2 ;;
    *) ONLY+=("$a") ;;
  esac
done
[ "$SMOKE" = 1 ] && SMOKE=1 || SMOKE=0

export OUT=${OUT:-/tmp/gpu-run}
mkdir -p "$OUT" "$OUT/xla-notriton" || exit 2
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR-/tmp/specjax-jax-cache}
unset XLA_FLAGS
NOTRITON=--xla_gpu_enable_triton_gemm=false
if [ "$SMOKE" = 1 ]; then BUDGET=${BUDGET:-3000}; else BUDGET=${BUDGET:-540}; fi
MIN_STEP=${MIN_STEP:-20}
KILL_AFTER=15
LOG="$OUT/run_all.log"

# Runs a script (or -m MODULE) with SIGTERM raising SystemExit, so its finally blocks run.
WRAP='import os, runpy, signal, sys
def stop(signum, frame):
    raise SystemExit(128 + signum)
signal.signal(signal.SIGTERM, stop)
args = sys.argv[1:]
if args[0] == "-m":
    sys.argv = args[1:]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = args
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
    runpy.run_path(args[0], run_name="__main__")'

B=docs/bench/gpu
if [ "$SMOKE" = 1 ]; then
  # README.md's CPU smoke arguments; 1b and 8b become tiny; bench --profile at its smallest.
  # (--size llama-tiny is tiny's pair too, under its own JSON name: 8b's steps write there)
  SYN=(--dtype float32 --batches 1 --ks 2 --max-new 16 --pass-tokens 1 2)
  SYNTH_1B_HF=(--size tiny "${SYN[@]}" --tree 2 2 4 --hf)
  SYNTH_8B=(--size llama-tiny "${SYN[@]}")
  SYNTH_1B=(--size tiny "${SYN[@]}")
  SHIPPED=(--prompts 2 --batches 1 --ks 2 --max-new 8)
  SELFDRAFT=(--prompts 2 --ks 2 --max-new 8)
  PROFILE=(--batches 1 -k 1 --num-prompts 1 --prompt-tokens 8 --max-new-tokens 4 --repeats 1
           --profile-tree 2,2 --tree-nodes 2)
  ATTN_1B=(--size tiny --dtype float32 --cases 2 --max-new 8) ATTN_8B=(--size llama-tiny --dtype float32 --cases 1 --max-new 0)
  PARTS_1B=tiny PARTS_8B=tiny
  GEMV_1B=(tiny separate,fused,python) GEMV_8B=(tiny separate,fused,python)
  GEMV_1B_NT=(tiny separate,fused,python) GEMV_8B_NT=(tiny separate,fused,python)
  CAP() { echo 600; }
else
  SYNTH_1B_HF=(--size 1b --tree 6 2 20 --hf --ks 5 7 --batches 1 8 --pass-tokens 1 8 32 --max-new 128)
  SYNTH_8B=(--size 8b --ks 5 --batches 1 --pass-tokens 1 8 --max-new 64)
  SYNTH_1B=(--size 1b --ks 5 --batches 1 8 --pass-tokens 1 8 32 --max-new 128)
  SHIPPED=(--ks 4 --batches 1 8 --max-new 128)
  SELFDRAFT=(--ks 4 --max-new 128)
  PROFILE=(--batches 1 4 16 -k 6 --num-prompts 16 --repeats 3 --max-new-tokens 64
           --profile-tree 4,2 --tree-nodes 4 8 12)
  ATTN_1B=(--size 1b --max-new 128) ATTN_8B=(--size 8b --cases 3 --max-new 0)
  PARTS_1B=1b PARTS_8B=8b
  GEMV_1B=(1b python,separate,fused) GEMV_8B=(8b python,separate,fused)
  GEMV_1B_NT=(1b scan,python,separate,fused) GEMV_8B_NT=(8b scan,python,separate,fused)
  CAP() { echo "$1"; }
fi

# name | cap (s) | command (env ... python-wrapped script and arguments)
STEPS=(bench-profile parts-1b parts-8b selfdraft attention-1b attention-8b synth-1b-hf synth-8b shipped
       synth-8b-notriton synth-1b-notriton gemv-1b gemv-8b gemv-1b-notriton gemv-8b-notriton)
cmd_of() {
  local nt=(env XLA_FLAGS=$NOTRITON OUT="$OUT/xla-notriton")
  case "$1" in
    synth-1b-hf)       CMD=("$B/gpubench.py" synth "${SYNTH_1B_HF[@]}"); CAPS=$(CAP 150) ;;
    synth-8b)          CMD=("$B/gpubench.py" synth "${SYNTH_8B[@]}"); CAPS=$(CAP 150) ;;
    shipped)           CMD=("$B/gpubench.py" shipped "${SHIPPED[@]}"); CAPS=$(CAP 150) ;;
    bench-profile)     CMD=(-m specjax.cli bench --profile --out "$OUT" "${PROFILE[@]}"); CAPS=$(CAP 240) ;;
    attention-1b)      CMD=("$B/gpubench.py" attention "${ATTN_1B[@]}"); CAPS=$(CAP 90) ;;
    attention-8b)      CMD=("$B/gpubench.py" attention "${ATTN_8B[@]}"); CAPS=$(CAP 90) ;;
    parts-1b)          CMD=("$B/parts.py" "$PARTS_1B"); CAPS=$(CAP 45) ;;
    parts-8b)          CMD=("$B/parts.py" "$PARTS_8B"); CAPS=$(CAP 60) ;;
    selfdraft)         CMD=("$B/gpubench.py" selfdraft "${SELFDRAFT[@]}"); CAPS=$(CAP 50) ;;
    synth-8b-notriton) CMD=("$B/gpubench.py" synth "${SYNTH_8B[@]}"); CAPS=$(CAP 150) ;;
    synth-1b-notriton) CMD=("$B/gpubench.py" synth "${SYNTH_1B[@]}"); CAPS=$(CAP 90) ;;
    gemv-1b)           CMD=("$B/f58689a/gemv.py" "${GEMV_1B[@]}"); CAPS=$(CAP 45) ;;
    gemv-8b)           CMD=("$B/f58689a/gemv.py" "${GEMV_8B[@]}"); CAPS=$(CAP 60) ;;
    gemv-1b-notriton)  CMD=("$B/f58689a/gemv.py" "${GEMV_1B_NT[@]}"); CAPS=$(CAP 45) ;;
    gemv-8b-notriton)  CMD=("$B/f58689a/gemv.py" "${GEMV_8B_NT[@]}"); CAPS=$(CAP 60) ;;
    *) return 1 ;;
  esac
  case "$1" in
    *-notriton) PRE=("${nt[@]}") ;;
    *) PRE=(env) ;;
  esac
}

if [ "$LIST" = 1 ]; then
  for s in "${STEPS[@]}"; do cmd_of "$s"; echo "$s (cap ${CAPS}s): ${PRE[*]:1} $PYTHON ${CMD[*]}"; done
  exit 0
fi
for s in "${ONLY[@]}"; do
  cmd_of "$s" || { echo "run_all.sh: no step $s; steps: ${STEPS[*]}" >&2; exit 2; }
done

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { printf '%d.%03d' $(( $1 / 1000 )) $(( $1 % 1000 )); }
say() { echo "$*" | tee -a "$LOG"; }

: > "$LOG"
T0=$(now_ms)
DEADLINE=$(( T0 + BUDGET * 1000 ))
say "run_all.sh $(date -u +%FT%TZ) smoke=$SMOKE budget=${BUDGET}s out=$OUT python=$PYTHON"
say "git $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
SUMMARY=()
n=0
for s in "${STEPS[@]}"; do
  if [ ${#ONLY[@]} -gt 0 ] && ! printf '%s\n' "${ONLY[@]}" | grep -qx -- "$s"; then continue; fi
  n=$((n + 1))
  cmd_of "$s"
  logf=$(printf '%s/%02d-%s.log' "$OUT" "$n" "$s")
  left=$(( (DEADLINE - $(now_ms)) / 1000 - KILL_AFTER ))
  cap=$CAPS
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt "$MIN_STEP" ]; then
    say "== $s: skipped (${left}s of the budget left, under MIN_STEP=${MIN_STEP}s)"
    SUMMARY+=("$(printf '%-18s skipped' "$s")")
    continue
  fi
  say "== $s (timeout ${cap}s): ${PRE[*]:1} $PYTHON ${CMD[*]}"
  t=$(now_ms)
  timeout -k "$KILL_AFTER" "$cap" "${PRE[@]}" "$PYTHON" -c "$WRAP" "${CMD[@]}" > "$logf" 2>&1
  rc=$?
  el=$(( $(now_ms) - t ))
  case $rc in
    0) st=passed ;;
    124|137) st="timed out" ;;
    *) st=failed ;;
  esac
  say "== $s: $st, exit $rc, $(secs $el)s (log $(basename "$logf"))"
  [ "$st" = passed ] || tail -n 5 "$logf" | sed 's/^/     | /' | tee -a "$LOG"
  SUMMARY+=("$(printf '%-18s %-9s exit %3d %8ss' "$s" "$st" "$rc" "$(secs $el)")")
done
say ""
say "summary ($(secs $(( $(now_ms) - T0 )))s in all, budget ${BUDGET}s):"
for l in "${SUMMARY[@]}"; do say "  $l"; done
say "passed $(printf '%s\n' "${SUMMARY[@]}" | grep -c ' passed '), failed $(printf '%s\n' "${SUMMARY[@]}" | grep -c ' failed '), timed out $(printf '%s\n' "${SUMMARY[@]}" | grep -c ' timed out '), skipped $(printf '%s\n' "${SUMMARY[@]}" | grep -c ' skipped')"
# (packed outside $OUT, then moved in: a tarball written into the folder it packs changes it, and tar fails)
PACK=$(mktemp "${TMPDIR:-/tmp}/run_all.XXXXXX") && tar czf "$PACK" -C "$OUT" --exclude 00-all.tgz . \
  && mv "$PACK" "$OUT/00-all.tgz"
