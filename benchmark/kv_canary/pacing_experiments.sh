#!/usr/bin/env bash
# The decode speed-up runs of benchmark/results/latency_h200.md, one after the other on one
# GPU, into folder $1: E1-E3 ("Why raise decodes faster: the runs that decide"; E3's block is
# sized from E1's raise install line), E4 (off with an empty / a one-kernel side-stream branch
# forked and joined around the model, as the canary's) and E5 (raise again: the drift since
# E1). Device machine, PYTHONPATH with sglang's site; about 9 minutes on an H200 (E1 alone about
# 2). STEPS="1 4 5" runs only those (default: all; E3 needs E1). Usage: bash benchmark/kv_canary/pacing_experiments.sh OUT_DIR
set -euo pipefail
OUT=${1:?usage: pacing_experiments.sh OUT_DIR}
STEPS=${STEPS:-1 2 3 4 5}
for s in $STEPS; do
    case $s in 1|2|3|4|5) ;; *) echo "pacing_experiments: STEPS=$STEPS: the steps 1 to 5, e.g. STEPS='1 4 5'" >&2; exit 2 ;; esac
done
step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
case " $STEPS " in *" 3 "*) step 1 || { echo "pacing_experiments: STEPS=$STEPS: E3 is sized from E1: add 1" >&2; exit 2; } ;; esac
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
A=(--scenarios decode_bs1,decode_bs32 --runs 3 --cuda-graph-bs 1,32)
BENCH=benchmark/kv_canary/bench_serving_overhead.py
if step 1; then
echo "== E1 $(date -u +%T)"
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,clocks_event_reasons.active \
    --format=csv,noheader -lms 100 > "$OUT/smi.csv" &
SMI=$!
SGLANG_ENABLE_METRICS_DEVICE_TIMER=1 python "$BENCH" --configs off,raise "${A[@]}" --out "$OUT/e1.jsonl"
kill "$SMI" || true
fi
export PYTHONPATH=$PWD/benchmark/kv_canary/pacing_probe:${PYTHONPATH:-}
if step 2; then
for W in forward batch; do
    echo "== E2 $W $(date -u +%T)"
    KV_PACING_PROBE_WAIT=$W python "$BENCH" --configs off "${A[@]}" --out "$OUT/e2_$W.jsonl"
done
fi
if step 3; then
MIB=$(grep -ho "kv_canary installed.*device [0-9.]* MiB" "$OUT"/e1.jsonl.raise.log \
    | head -1 | sed 's/.*device \([0-9.]*\) MiB/\1/')
MIB=$(python -c "import math,sys; print(math.ceil(float(sys.argv[1])))" "${MIB:?no install line in the E1 raise log}")
echo "== canary device MiB (E1 raise): $MIB"
echo "== E3 $(date -u +%T)"
KV_PACING_PROBE_STREAMS=2 KV_PACING_PROBE_MIB=$MIB python "$BENCH" --configs off "${A[@]}" --out "$OUT/e3.jsonl"
fi
if step 4; then
for F in empty kernel; do
    echo "== E4 fork=$F $(date -u +%T)"
    KV_PACING_PROBE_FORK=$F python "$BENCH" --configs off "${A[@]}" --out "$OUT/e4_$F.jsonl"
done
fi
if step 5; then
echo "== E5 raise again (drift since E1) $(date -u +%T)"
SGLANG_ENABLE_METRICS_DEVICE_TIMER=1 python "$BENCH" --configs raise "${A[@]}" --out "$OUT/e5.jsonl"
fi
# the probe's own line is logged before sglang's logging is set up; its hooks show in the
# hook registry's lines (E2 forward: "Multiple AROUND hooks ... plugin=kv_pacing_probe")
grep -h "kv_pacing_probe" "$OUT"/e[234]*.log 2>/dev/null | sort | uniq -c || true
echo "== done $(date -u +%T)"
