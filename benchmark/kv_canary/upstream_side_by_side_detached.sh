#!/usr/bin/env bash
# The side by side with upstream's canary in one lease of the device tool, whose calls last at
# most 600 s while the runs take longer: `start` launches, in their own session, the overhead
# run (bench_interleaved.py) and then the detection and deployment runs
# (detect_side_by_side.py); `wait N` waits up to N seconds, then puts the logs, the JSON lines
# and a tarball of the whole run folder (every server's log with it) under $OUT. From the repository root on the GPU machine,
# with the bundles of ../shared/device/bundle.sh, test/device_bundle_nsa.sh and
# benchmark/kv_canary/upstream_bundle.sh built here (carries stay under 64 MB a call):
#   call 1 (carry .device/a .device/setup.sh):                  . .device/a/setup.sh
#   call 2 (carry .device/b .device/c):                          pip install --target /tmp/site
#          .device/c's wheels and untar .device/b into it (test/gpu_lanes_detached.sh's header)
#   call 3 (carry .device/d .device/up_b):                       bash .device/d/install.sh && bash $0 install up_b
#   call 4 (carry .device/up_a):                                 bash $0 install up_a
#   call 5 (carry .device/up_c), at once:                        bash $0 install up_c && bash $0 start && bash $0 wait 540
#   calls 6.., at once, until it says finished:                  bash $0 wait 570
# (bundle a and b no longer fit one call's 64 MB beside the tree)
# PART: the runs, in order, comma-separated from overhead and detect (default both =
# overhead,detect); STACKS the detection's stacks (default both); SCENARIOS, CONFIGS, ROUNDS,
# WARMUP, JOBS and DETECT_TIMEOUT (seconds per detection run, default 900) override
# the defaults below, GPU_SHARE and MAX_TOTAL_TOKENS bench_interleaved.py's (each server's memory
# share and KV pool), ISOLATE=1 its --isolate, TWINS its --twins; SIDE_BY_SIDE_DIR (the run folder) and SITE_UP (upstream's site) the paths.
set -u
R=${SIDE_BY_SIDE_DIR:-/tmp/side_by_side_run}
SITE_UP=${SITE_UP:-/tmp/site_up}
# six configs and the two stacks' A/A twins: eight servers start in about a third of a lease
# (add raise+all,up:raise+all through CONFIGS for real data `all`)
CONFIGS=${CONFIGS:-off,raise,raise+token+partial,up:off,up:raise,up:raise+token+partial}
SCENARIOS=${SCENARIOS:-prefill_bs1_512,prefill_bs1_4k,prefill_bs1_16k,decode_bs1,decode_bs32}
case "${1:-}" in
  install)
    shift
    . .device/a/setup.sh > /dev/null 2>&1 || { echo "setup of bundle a failed" >&2; exit 1; }
    for b in "$@"; do
      case "$b" in
        a|b|c) ;;  # setup.sh above installs every one of these that is present
        *) bash ".device/$b/install.sh" || { echo "install of .device/$b failed" >&2; exit 1; } ;;
      esac
    done
    echo "side_by_side: installed $*" ;;
  start)
    PARTS=${PART:-both}
    [ "$PARTS" = both ] && PARTS=overhead,detect
    for part in ${PARTS//,/ }; do
      case "$part" in overhead|detect) ;;
        *) echo "PART=${PART}: allowed overhead, detect (comma-separated, in order) or both" >&2
           exit 2 ;; esac
    done
    . .device/a/setup.sh > /dev/null 2>&1 || exit 1
    # upstream's sglang must come from $SITE_UP, not from this project's site behind it
    python3 -c "import os, sys; site = os.path.realpath(sys.argv[1]); sys.path.insert(0, site)
try:
    import sglang
except ImportError:
    sys.exit(1)
if not os.path.realpath(sglang.__file__).startswith(site + os.sep):
    sys.exit(1)
print('upstream', sglang.__version__)" "$SITE_UP" 2>/dev/null \
      || { echo "side_by_side: upstream's sglang is not in $SITE_UP" >&2; exit 1; }
    rm -rf "$R"; mkdir -p "$R"
    { git log -1 --format=%H; git status --short; } > "$R/tree.txt" 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt" 2>&1
    export PYTHONUNBUFFERED=1 R SITE_UP CONFIGS SCENARIOS GPU_SHARE MAX_TOTAL_TOKENS PARTS STACKS ISOLATE DETECT_TIMEOUT TWINS
    setsid nohup bash -c '
      date -u +%FT%TZ > "$R/start.txt"
      for part in ${PARTS//,/ }; do
        if [ "$part" = overhead ]; then
          python3 benchmark/kv_canary/bench_interleaved.py --upstream-site "$SITE_UP" \
            --configs "$CONFIGS" --piecewise off --scenarios "$SCENARIOS" \
            --rounds "${ROUNDS:-12}" --warmup "${WARMUP:-2}" --start-timeout 900 \
            ${GPU_SHARE:+--gpu-share "$GPU_SHARE"} ${MAX_TOTAL_TOKENS:+--max-total-tokens "$MAX_TOTAL_TOKENS"} \
            ${ISOLATE:+--isolate} ${TWINS:+--twins "$TWINS"} --out "$R/overhead.jsonl" > "$R/overhead.log" 2>&1
          echo "overhead rc=$?" >> "$R/summary.txt"
        else
          python3 benchmark/kv_canary/detect_side_by_side.py --upstream-site "$SITE_UP" \
            ${STACKS:+--stacks "$STACKS"} --jobs "${JOBS:-4}" --timeout "${DETECT_TIMEOUT:-900}" \
            --logs "$R/detect_logs" --json "$R/detect.json" > "$R/detect.log" 2>&1
          echo "detect rc=$?" >> "$R/summary.txt"
        fi
      done
      date -u +%FT%TZ > "$R/end.txt"' > /dev/null 2>&1 < /dev/null &
    echo "side_by_side: started; logs in $R" ;;
  wait)
    for _ in $(seq 1 $(( ${2:-500} / 5 ))); do [ -f "$R/end.txt" ] && break; sleep 5; done
    mkdir -p "${OUT:?}"
    # few files (the device tool returns a limited number): every server's and every
    # detection run's log is in the tarball only (bench_interleaved writes <out>.<config>.log)
    cp "$R"/*.txt "$R"/overhead.log "$R"/detect.log "$R"/*.jsonl "$R"/*.json "$OUT/" 2>/dev/null
    tar czf "$OUT/side_by_side_run.tgz" -C "$(dirname "$R")" "$(basename "$R")"
    cat "$R/summary.txt" 2>/dev/null
    tail -5 "$R/overhead.log" "$R/detect.log" 2>/dev/null
    if [ -f "$R/end.txt" ]; then echo "side_by_side: finished"; else echo "side_by_side: still running; wait again"; fi ;;
  *) echo "usage: $0 install BUNDLE... | start | wait SECONDS" >&2; exit 2 ;;
esac
