#!/usr/bin/env bash
# The whole GPU suite through the device tool, whose calls last at most 600 s while the suite
# takes longer: `start` installs the bundles and starts the lanes in their own session (they
# outlive the call); `wait N` waits up to N seconds for them, then puts the summary and a
# tarball of every lane log and server log under $OUT. From the repository root:
#   call 1 (carry .device/a .device/setup.sh):  . .device/a/setup.sh
#   call 2 (carry .device/b .device/c):  python3 -m pip install -q --no-index --no-deps --no-compile \
#        --no-cache-dir --upgrade --target /tmp/site .device/c/*.whl; tar xzf .device/b/sgl_kernel_slim.tgz -C /tmp/site
#   call 3 (carry .device/d .device/pd_a):  bash .device/d/install.sh; export PYTHONPATH=/tmp/site;
#        bash .device/pd_a/install.sh; GPU_LANES_INSTALLED=1 JOBS=10 bash test/gpu_lanes_detached.sh start &&
#        bash test/gpu_lanes_detached.sh wait 520
#   calls 4.., at once, until it prints the summary:  bash test/gpu_lanes_detached.sh wait 560
# (the bundles no longer fit fewer calls' 64 MB beside the tree)
# LANES="a b" runs only those lanes; JOBS=N sets the lanes at once (default: cores - 2);
# GPU_LANES_INSTALLED=1: the bundles are already installed in /tmp/site (skip the installs).
# monitor.txt samples the load, the GPU and the busiest processes every 15 s while it runs.
set -u
R=/tmp/gpu_lanes_run
case "${1:-}" in
  start)
    if [ "${GPU_LANES_INSTALLED:-0}" = 1 ]; then  # an earlier call of this machine installed
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
      . .device/a/setup.sh || exit 1
      [ -f .device/d/install.sh ] && { bash .device/d/install.sh || exit 1; }
      # Mooncake's TransferEngine for the PD lane (into /tmp/site, which setup.sh put on PYTHONPATH)
      [ -f .device/pd_a/install.sh ] && { bash .device/pd_a/install.sh || exit 1; }
    fi
    rm -rf "$R"; mkdir -p "$R"
    { git log -1 --format=%H; git status --short; } > "$R/tree.txt" 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpu.txt" 2>&1
    export PYTHONUNBUFFERED=1 KV_CANARY_E2E_LOG_DIR="$R/e2e_logs" OUT="$R/lanes"
    [ -n "${JOBS:-}" ] && export GPU_LANES_JOBS="$JOBS"
    setsid nohup bash -c 'while [ ! -f '"$R"'/end.txt ]; do date -u +%T; cat /proc/loadavg
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
      top -bn1 -o %CPU -c -w 200 | sed -n 7,22p; sleep 15; done' > "$R/monitor.txt" 2>&1 < /dev/null &
    setsid nohup bash -c 'date -u +%FT%TZ > '"$R"'/start.txt
      bash test/gpu_lanes.sh '"${LANES:-}"' > '"$R"'/summary.txt 2>&1; echo "rc=$?" >> '"$R"'/summary.txt
      date -u +%FT%TZ > '"$R"'/end.txt' > /dev/null 2>&1 < /dev/null &
    echo "gpu_lanes_detached: started; logs in $R" ;;
  wait)
    for _ in $(seq 1 $(( ${2:-500} / 5 ))); do [ -f "$R/end.txt" ] && break; sleep 5; done
    cp "$R/summary.txt" "${OUT:?}/" 2>/dev/null
    tar czf "$OUT/gpu_lanes_run.tgz" -C "$(dirname "$R")" "$(basename "$R")"
    cat "$R/summary.txt"
    [ -f "$R/end.txt" ] || echo "gpu_lanes_detached: still running; wait again" ;;
  *) echo "usage: $0 start | wait SECONDS" >&2; exit 2 ;;
esac
