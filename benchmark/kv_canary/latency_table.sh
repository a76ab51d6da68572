#!/usr/bin/env bash
# The latency table (benchmark/results/latency_h200.md): every scenario of the latency targets
# as paired, interleaved server runs with the A/A control, one bench_interleaved.py run per
# part, the parts dealt over the GPUs in turn (one part at a time per GPU: a part's servers
# share its GPU only). Meant for a quiet machine: a device call of its own, or the detached
# job's AFTER (test/gpu_lanes_detached.sh; LANES=none runs no lane).
#   bash benchmark/kv_canary/latency_table.sh OUTDIR [PART ...]
# Parts (default: all four, in this order):
#   prefill        prefill bs 1 at 512, 4096 and 16384 tokens; off, raise, raise+token+partial;
#                  REPEAT requests per server and round (--repeat: a short prefill's own noise)
#   prefill-bs32   prefill bs 32 x 16384; the same configs, one request per round (four
#                  servers on one H200 get about 25 GiB of KV each, some 230k tokens of
#                  Qwen3-0.6B: the batch's 32 requests are admitted as others finish; its
#                  chunks are the same forwards either way)
#   decode         decode bs 1, 32 and 128; the same configs and off+sidekernel (the second
#                  baseline: a canary-off decode graph with one side-stream kernel, latency_h200.md,
#                  thirty-fifth session); OSL tokens per request
#   eagle          EAGLE decode bs 1 and 32 (--speculative eagle); off, raise, raise+token+partial
# Every run: --baseline off (its A/A twin on: bench_interleaved.py's --control), --isolate,
# --start together. Settings: ROUNDS (default 30), REPEAT (default 5), OSL (default 256),
# WARMUP (default 2). Per part: OUTDIR/latency_PART.jsonl (the records) and .log; prints one
# line per part with its exit status, then the table of every record (--report).
set -u
out=${1:?usage: $0 OUTDIR [PART ...]}; shift
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(prefill prefill-bs32 decode eagle)
for p in "${parts[@]}"; do
  case "$p" in
    prefill|prefill-bs32|decode|eagle) ;;
    *) echo "$0: part $p: allowed prefill, prefill-bs32, decode, eagle" >&2; exit 2 ;;
  esac
done
whole() {  # NAME VALUE: a whole number above 0, or exit 2 naming the variable
  case "$2" in
    ""|*[!0-9]*|0*) echo "$0: $1=$2: a whole number above 0" >&2; exit 2 ;;
  esac
}
rounds=${ROUNDS:-30}; whole ROUNDS "$rounds"
repeat=${REPEAT:-5}; whole REPEAT "$repeat"
osl=${OSL:-256}; whole OSL "$osl"
warmup=${WARMUP:-2}
case "$warmup" in ""|*[!0-9]*) echo "$0: WARMUP=$warmup: a whole number (0: none)" >&2; exit 2 ;; esac
here=$(cd "$(dirname "$0")" && pwd)
. "$here/gpu_deal.sh"
mkdir -p "$out"
canary=off,raise,raise+token+partial
part_args() {  # PART: its bench_interleaved.py arguments
  case "$1" in
    prefill) echo "--configs $canary --scenarios prefill_bs1_512,prefill_bs1_4k,prefill_bs1_16k --repeat $repeat" ;;
    prefill-bs32) echo "--configs $canary --scenarios prefill_bs32" ;;
    decode) echo "--configs $canary,off+sidekernel --scenarios decode_bs1,decode_bs32,decode_bs128 --osl $osl" ;;
    eagle) echo "--speculative eagle --configs $canary --scenarios decode_bs1,decode_bs32 --osl $osl" ;;
  esac
}
run_gpu() {  # GPU, then its parts
  local gpu=$1; shift
  for p in "$@"; do
    # shellcheck disable=SC2046  # part_args is a fixed list of words
    CUDA_VISIBLE_DEVICES=$gpu python3 "$here/bench_interleaved.py" $(part_args "$p") \
      --baseline off --rounds "$rounds" --warmup "$warmup" --isolate --start together \
      --out "$out/latency_$p.jsonl" > "$out/latency_$p.log" 2>&1
    echo "latency_table: $p on GPU $gpu: rc=$?"
  done
}
deal_over_gpus run_gpu "${parts[@]}"
shopt -s nullglob
records=("$out"/latency_*.jsonl)
[ ${#records[@]} -gt 0 ] && python3 "$here/bench_interleaved.py" --report "${records[@]}"
