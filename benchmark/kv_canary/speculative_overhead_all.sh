#!/usr/bin/env bash
# Each --speculative mode's paired decode bs 1 / bs 32 rows with the A/A control
# (benchmark/results/speculative_h200.md, "Overhead per mode"), the modes dealt over the GPUs
# in turn, one mode at a time per GPU (the interleaved servers of one mode share its GPU only).
#   bash benchmark/kv_canary/speculative_overhead_all.sh OUTDIR [MODE ...]
# Default modes: every mode of bench_interleaved.py --speculative but none. ROUNDS (default 8);
# SCENARIOS (default decode_bs1,decode_bs32; e.g. decode_bs32 for a mode whose bs 1 row is in);
# START (default together: a mode's three servers start at once, bench_interleaved.py --start);
# every server but the one measured paused during a request (--isolate, the latency method).
# multi-layer decodes without CUDA graphs (about 25 tokens/s on an H200 with the Step-3.5
# shape: a 1024-token request takes 40 s), so its requests are 256 tokens long (--osl 256).
# OSL=N: every mode's requests N tokens long (--osl N, multi-layer's too; unset: 1024, and
# 256 for multi-layer), to fit a mode's rounds into one device call.
# Per mode: OUTDIR/spec_MODE.jsonl (the records) and OUTDIR/spec_MODE.log; prints one line per
# mode with its exit status, then the table of every record (bench_interleaved.py --report).
set -u
out=${1:?usage: $0 OUTDIR [MODE ...]}; shift
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(eagle eagle-tree eagle3 standalone ngram dflash adaptive nextn frozen-kv-mtp multi-layer)
rounds=${ROUNDS:-8}
case "$rounds" in ""|*[!0-9]*|0) echo "$0: ROUNDS=$rounds: a whole number above 0" >&2; exit 2 ;; esac
start=${START:-together}
scenarios=${SCENARIOS:-decode_bs1,decode_bs32}
case ",$scenarios," in
  *,,*|*[!a-z0-9_,]*) echo "$0: SCENARIOS=$scenarios: a comma-separated list of decode_bs1, decode_bs32" >&2; exit 2 ;;
esac
for sc in ${scenarios//,/ }; do
  case "$sc" in decode_bs1|decode_bs32) ;; *) echo "$0: SCENARIOS=$scenarios: $sc is not one of decode_bs1, decode_bs32" >&2; exit 2 ;; esac
done
case "$start" in serial|together) ;; *) echo "$0: START=$start: allowed serial, together" >&2; exit 2 ;; esac
osl_all=${OSL:-}
case "$osl_all" in
  "") ;;
  *[!0-9]*|0*) echo "$0: OSL=$osl_all: a whole number above 0 (tokens per request)" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")" && pwd)
. "$here/gpu_deal.sh"
mkdir -p "$out"
run_gpu() {  # GPU, then its modes
  local gpu=$1; shift
  for m in "$@"; do
    osl=()
    if [ -n "$osl_all" ]; then osl=(--osl "$osl_all"); elif [ "$m" = multi-layer ]; then osl=(--osl 256); fi
    # on the target the mode's draft is made for (bench_interleaved.py's default --model)
    CUDA_VISIBLE_DEVICES=$gpu python3 "$here/bench_interleaved.py" --speculative "$m" \
      --configs off,raise --scenarios "$scenarios" --rounds "$rounds" --warmup 1 \
      --start "$start" --isolate "${osl[@]}" \
      --out "$out/spec_$m.jsonl" > "$out/spec_$m.log" 2>&1
    echo "speculative_overhead: $m on GPU $gpu: rc=$?"
  done
}
deal_over_gpus run_gpu "${modes[@]}"
shopt -s nullglob
records=("$out"/spec_*.jsonl)
[ ${#records[@]} -gt 0 ] && python3 "$here/bench_interleaved.py" --report "${records[@]}"
