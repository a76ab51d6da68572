#!/usr/bin/env bash
# The whole GPU suite through the device tool, whose calls last at most 600 s and carry at most
# 64 MiB beside the tree (docs/testing.md, "The GPU suite"). The bundles (built here by
# `bash ../shared/device/bundle.sh && bash test/device_bundle_nsa.sh && bash test/device_bundle_pd.sh`)
# go in two calls; `start` runs the lanes in their own session (they outlive the call) over every
# GPU the machine has; `wait N` waits up to N seconds, then puts the summary and a tarball of
# every lane log and server log under $OUT. From the repository root:
#   call 1 (carry .device/a .device/pd_a):          bash test/gpu_lanes_detached.sh install 1
#   call 2 (carry .device/b .device/c .device/d):   bash test/gpu_lanes_detached.sh install 2 &&
#        JOBS=20 bash test/gpu_lanes_detached.sh start && bash test/gpu_lanes_detached.sh wait 480
#   calls 3.., at once, carrying nothing, until it prints the summary:
#        bash test/gpu_lanes_detached.sh wait 560
# LANES="a b" runs only those lanes, LANES=none none (a detached AFTER or STORMS alone: a
# measurement that outlives the calls); JOBS=N sets the lanes at once (default: cores - 2);
# GPUS=0,1 (or a count) the GPUs to spread them over (default: all). STORMS=SECONDS: after the
# lanes, heal mode's storm (benchmark/kv_canary/abort_storm.py, streaming clients) at page
# sizes 1 and 16 for that long, side by side on the first two GPUs (one after the other on
# one GPU); their logs under storms/, their verdicts in summary.txt. STORMS_WITH_LANES=1 starts
# the storms beside the lanes instead (the storms check containment, not time: their latencies
# then include the lanes' load), both on the last GPU (the first is the "alone" lanes':
# GPU suite run 35 put the page 1 storm there and memory_gpu_alone failed); give the lanes two
# jobs fewer (JOBS). Two GPUs or more. AFTER='command': run once the lanes and storms have
# ended, in the lanes' copy of the tree (a measurement that needs quiet GPUs, in the same
# detached job: no call to start it, nothing to poll); $AFTER_OUT is its folder (in the
# tarball), its output's tail goes into summary.txt.
# monitor.txt samples the load, the host's memory (free -m), the GPUs and the busiest processes
# every 15 s while it runs.
# Each device call re-sends the tree, replacing its files: `start` runs the lanes from a copy
# of it (/tmp/gpu_lanes_tree, this project installed editable from there), so a later call
# cannot pull a file from under a running lane.
set -u
R=/tmp/gpu_lanes_run
T=/tmp/gpu_lanes_tree
SITE=/tmp/site
case "${1:-}" in
  install)
    mkdir -p "$SITE"; export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    case "${2:-}" in
      1)  # sglang and its pure-Python dependencies, this project (editable), Mooncake (PD lanes)
        for f in .device/a/setup.sh .device/pd_a/install.sh; do
          [ -f "$f" ] || { echo "gpu_lanes_detached: $f missing: carry .device/a .device/pd_a" >&2; exit 1; }
        done
        . .device/a/setup.sh || exit 1
        bash .device/pd_a/install.sh || exit 1 ;;
      2)  # sgl_kernel, flashinfer and the Engine's extras, the NSA lane's kernels
        for f in .device/b/sgl_kernel_slim.tgz .device/c .device/d/install.sh; do
          [ -e "$f" ] || { echo "gpu_lanes_detached: $f missing: carry .device/b .device/c .device/d" >&2; exit 1; }
        done
        python3 -c "import sglang" 2>/dev/null || { echo "gpu_lanes_detached: run 'install 1' first" >&2; exit 1; }
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target "$SITE" .device/c/*.whl || exit 1
        tar xzf .device/b/sgl_kernel_slim.tgz -C "$SITE" || exit 1
        bash .device/d/install.sh || exit 1
        python3 -c "import sgl_kernel, flashinfer, sglang.srt.kv_canary; print('gpu_lanes_detached: installed')" || exit 1 ;;
      *) echo "usage: $0 install 1|2" >&2; exit 2 ;;
    esac ;;
  start)
    case "${STORMS:-}" in
      ""|*[!0-9]*) [ -z "${STORMS:-}" ] || { echo "gpu_lanes_detached: STORMS=$STORMS: seconds, a whole number" >&2; exit 2; } ;;
    esac
    case "${STORMS_WITH_LANES:-0}" in
      0|1) ;;
      *) echo "gpu_lanes_detached: STORMS_WITH_LANES=$STORMS_WITH_LANES: 0 or 1" >&2; exit 2 ;;
    esac
    if [ "${LANES:-}" = none ] && [ -z "${AFTER:-}" ] && [ -z "${STORMS:-}" ]; then
      echo "gpu_lanes_detached: LANES=none runs no lane: give AFTER='command' or STORMS=SECONDS" >&2
      exit 2
    fi
    storms_at=after; [ -n "${STORMS:-}" ] && [ "${STORMS_WITH_LANES:-0}" = 1 ] && storms_at=with
    if [ "$storms_at" = with ] && [ "$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)" -lt 2 ]; then
      echo "gpu_lanes_detached: STORMS_WITH_LANES=1 needs 2 GPUs or more (the alone lanes keep the first): drop it" >&2
      exit 2
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    python3 -c "import sgl_kernel, sglang" 2>/dev/null \
      || { echo "gpu_lanes_detached: not installed: run 'install 1' and 'install 2' first" >&2; exit 1; }
    rm -rf "$R" "$T"; mkdir -p "$R" "$T"
    { git log -1 --format=%H; git status --short; } > "$R/tree.txt" 2>&1
    # the lanes' own copy of the tree (tracked and untracked-not-ignored files), installed
    python3 - "$T" <<'EOF' || { echo "gpu_lanes_detached: could not copy the tree to $T" >&2; exit 1; }
import os, shutil, subprocess, sys
listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"],
                        capture_output=True, check=True).stdout.decode().split("\0")
for f in filter(os.path.lexists, filter(None, listed)):  # a deleted tracked file: not copied
    os.makedirs(os.path.join(sys.argv[1], os.path.dirname(f)), exist_ok=True)
    shutil.copy2(f, os.path.join(sys.argv[1], f), follow_symlinks=False)
EOF
    (cd "$T" && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .) \
      || { echo "gpu_lanes_detached: could not install the copy in $T" >&2; exit 1; }
    cd "$T" || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt" 2>&1
    export PYTHONUNBUFFERED=1 KV_CANARY_E2E_LOG_DIR="$R/e2e_logs" OUT="$R/lanes"
    export GPU_LANES_AFTER="${AFTER:-}"
    [ -n "${JOBS:-}" ] && export GPU_LANES_JOBS="$JOBS"
    [ -n "${GPUS:-}" ] && export GPU_LANES_GPUS="$GPUS"
    setsid nohup bash -c 'while [ ! -f '"$R"'/end.txt ]; do date -u +%T; cat /proc/loadavg
      free -m | sed -n 2p
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
      top -bn1 -o %CPU -c -w 200 | sed -n 7,22p; sleep 15; done' > "$R/monitor.txt" 2>&1 < /dev/null &
    setsid nohup bash -c 'date -u +%FT%TZ > '"$R"'/start.txt
      [ "'"$storms_at"'" = with ] && { bash test/gpu_lanes_detached.sh storms '"${STORMS:-0}"' beside > '"$R"'/storms.txt 2>&1 & }
      if [ "'"${LANES:-}"'" = none ]; then echo "gpu_lanes_detached: no lanes (LANES=none)" > '"$R"'/summary.txt
      else bash test/gpu_lanes.sh '"${LANES:-}"' > '"$R"'/summary.txt 2>&1; echo "rc=$?" >> '"$R"'/summary.txt; fi
      [ -n "'"${STORMS:-}"'" ] && [ "'"$storms_at"'" = after ] && bash test/gpu_lanes_detached.sh storms '"${STORMS:-0}"' >> '"$R"'/summary.txt 2>&1
      wait; [ -f '"$R"'/storms.txt ] && cat '"$R"'/storms.txt >> '"$R"'/summary.txt
      if [ -n "$GPU_LANES_AFTER" ]; then
        mkdir -p '"$R"'/after; echo "== after: $GPU_LANES_AFTER" >> '"$R"'/summary.txt
        AFTER_OUT='"$R"'/after bash -c "$GPU_LANES_AFTER" > '"$R"'/after/log.txt 2>&1
        echo "after: rc=$?" >> '"$R"'/summary.txt; tail -60 '"$R"'/after/log.txt >> '"$R"'/summary.txt
      fi
      date -u +%FT%TZ > '"$R"'/end.txt' > /dev/null 2>&1 < /dev/null &
    echo "gpu_lanes_detached: started; logs in $R" ;;
  storms)  # (run by start, after the lanes) heal storms at page 1 and 16
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    mkdir -p "$R/storms"
    mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader)
    run_storm() {  # page size, GPU
      CUDA_VISIBLE_DEVICES=$2 python3 benchmark/kv_canary/abort_storm.py --mode heal --stream \
        --seconds "${3:?}" --idle-seconds 10 --device cuda --page-size "$1" \
        --out "$R/storms/page_$1" > "$R/storms/page_$1.log" 2>&1
      echo "storm page $1 (GPU $2): rc=$?"; grep "^abort_storm: \|^RESULT" "$R/storms/page_$1.log"
    }
    if [ "${3:-}" = beside ]; then
      # beside the lanes: both on the last GPU, never the first, where gpu_lanes_run.py puts
      # its "alone" lanes (they read the GPU's free memory: a storm's server there moves it)
      last=${gpus[${#gpus[@]}-1]}  # start checked there are two or more
      run_storm 1 "$last" "$2" > "$R/storms/page_1.verdict" &
      run_storm 16 "$last" "$2" > "$R/storms/page_16.verdict"
      wait
    elif [ "${#gpus[@]}" -ge 2 ]; then
      run_storm 1 "${gpus[0]}" "$2" > "$R/storms/page_1.verdict" &
      run_storm 16 "${gpus[1]}" "$2" > "$R/storms/page_16.verdict"
      wait
    else
      run_storm 1 "${gpus[0]}" "$2" > "$R/storms/page_1.verdict"
      run_storm 16 "${gpus[0]}" "$2" > "$R/storms/page_16.verdict"
    fi
    cat "$R/storms/page_1.verdict" "$R/storms/page_16.verdict" ;;
  wait)
    for _ in $(seq 1 $(( ${2:-500} / 5 ))); do [ -f "$R/end.txt" ] && break; sleep 5; done
    cp "$R/summary.txt" "${OUT:?}/" 2>/dev/null
    tar czf "$OUT/gpu_lanes_run.tgz" -C "$(dirname "$R")" "$(basename "$R")"
    cat "$R/summary.txt"
    [ -f "$R/end.txt" ] || echo "gpu_lanes_detached: still running; wait again" ;;
  *) echo "usage: $0 install 1|2 | start | wait SECONDS | storms SECONDS [beside]" >&2; exit 2 ;;
esac
