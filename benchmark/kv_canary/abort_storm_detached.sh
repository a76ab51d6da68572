#!/usr/bin/env bash
# The 10-minute GPU storms of benchmark/results/containment.md through the device tool (calls
# last at most 600 s; a storm with its canary-off reference takes about 12 minutes): `start`
# starts them side by side in their own sessions (they outlive the call), `wait N` waits up
# to N seconds, copying each storm's output to $OUT as it goes (a call cut short still brings
# back what is done), then the canary's lines and the tail of each server log, all as
# $OUT/storms.tgz (a call cut short leaves them in $OUT/storms). Run after the bundles are installed and
# after `test/gpu_lanes_detached.sh start` when both run (its start reinstalls the bundles):
#   call 2:  bash test/gpu_lanes_detached.sh start && sleep 20 \
#            && bash benchmark/kv_canary/abort_storm_detached.sh start && ... wait 500
#   call 3:  bash benchmark/kv_canary/abort_storm_detached.sh wait 400
# STORMS="abort:1 abort:16 log:1 log:16" (mode:page size), SECONDS_OF_TRAFFIC=600.
set -u
R=/tmp/abort_storms
case "${1:-}" in
  start)
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    rm -rf "$R"; mkdir -p "$R"
    for spec in ${STORMS:-abort:1 abort:16 log:1 log:16}; do
      m=${spec%%:*}; p=${spec##*:}
      setsid nohup bash -c "python3 benchmark/kv_canary/abort_storm.py --mode $m --device cuda \
        --page-size $p --seconds ${SECONDS_OF_TRAFFIC:-600} --idle-seconds 15 \
        --out $R/${m}_$p > $R/${m}_$p.out 2>&1; echo rc=\$? >> $R/${m}_$p.out; \
        touch $R/${m}_$p.done" > /dev/null 2>&1 < /dev/null &
      sleep 15  # the first server compiles the JIT kernels the others then load
    done
    echo "abort_storm_detached: started; logs in $R" ;;
  wait)
    mkdir -p "${OUT:?}/storms"
    n=$(ls "$R"/*.out 2>/dev/null | wc -l)
    for _ in $(seq 1 $(( ${2:-500} / 5 ))); do
      cp "$R"/*.out "$OUT/storms/" 2>/dev/null
      [ "$(ls "$R"/*.done 2>/dev/null | wc -l)" -ge "$n" ] && break
      sleep 5
    done
    for f in "$R"/*.out; do echo "== $f"; grep -E "^RESULT|abort_storm: FAIL|^rc=" "$f" | cut -c1-1500; done
    # the servers' logs are large (every request's access line): what the results need of them
    for d in "$R"/*/; do
      b=$(basename "$d")
      grep -h "kv_canary abort:\|kv_canary perturb\|Leak\|Traceback\|Error" "$d"/storm.log \
        2>/dev/null | tail -3000 > "$OUT/storms/$b.canary_lines.txt"
      tail -300 "$d"/storm.log > "$OUT/storms/$b.storm_tail.txt" 2>/dev/null
      cp "$d"/results.json "$OUT/storms/$b.results.json" 2>/dev/null
    done
    # the device tool brings back at most 8 files: the storms' files as one archive
    tar czf "$OUT/storms.tgz" -C "$OUT" storms && rm -rf "$OUT/storms"
    echo "abort_storm_detached: $(ls "$R"/*.done 2>/dev/null | wc -l) of $n done" ;;
  *) echo "usage: $0 start | wait SECONDS" >&2; exit 2 ;;
esac
