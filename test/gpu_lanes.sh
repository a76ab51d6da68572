#!/usr/bin/env bash
# The GPU suites as parallel lanes on one GPU (one pytest per model shape / HiCache setup;
# about 10 min on an H100). On the device machine, from the repository root,
# after the bundles are installed (docs/architecture.md, "Tests"):
#   bash test/gpu_lanes.sh            # logs to $OUT (or ./gpu_lanes_out), the tail of each last
#   bash test/gpu_lanes.sh spec_pr_v2 spec_nextn   # only the lanes named
# Exit status: 0 only if every lane passed.
set -u
T=test/registered/kv_canary
out="${OUT:-gpu_lanes_out}"
mkdir -p "$out"
pids=()
want=" $* "
lane() {
  local name=$1; shift
  if [ "$want" != "  " ] && [[ "$want" != *" $name "* ]]; then return; fi
  timeout "${LANE_T:-540}" python3 -m pytest -q -x -p no:cacheprovider --tb=short "$@" \
    > "$out/$name.log" 2>&1 &
  pids+=("$!")
}
lane core $T/test_e2e_gpu.py -k "not piecewise"
lane piecewise $T/test_e2e_gpu.py -k piecewise
lane runtime_cuda $T/test_runtime_cuda.py $T/test_kernels_cuda_graph.py
lane shape_mla $T/test_e2e_model_shapes_gpu.py -k mla
lane shape_nsa $T/test_e2e_model_shapes_gpu.py -k nsa
lane shape_hybrid $T/test_e2e_model_shapes_gpu.py -k hybrid
lane hicache_kernel $T/test_e2e_hicache_gpu.py -k mha_kernel
lane hicache_page_first $T/test_e2e_hicache_gpu.py -k page_first
lane hicache_direct $T/test_e2e_hicache_gpu.py -k mha_direct
lane hicache_mla $T/test_e2e_hicache_gpu.py -k mla
lane spec_clean_v2 $T/test_e2e_speculative_gpu.py -k "clean and spec_v2"
lane spec_clean_v1 $T/test_e2e_speculative_gpu.py -k "clean and spec_v1"
lane spec_pr_v2 $T/test_e2e_speculative_gpu.py -k "pr and spec_v2"
lane spec_pr_v1 $T/test_e2e_speculative_gpu.py -k "pr and spec_v1"
lane spec_faults_v2 $T/test_e2e_speculative_gpu.py -k "fault and spec_v2"
lane spec_faults_v1 $T/test_e2e_speculative_gpu.py -k "fault and spec_v1"
lane spec_eagle3 $T/test_e2e_speculative_gpu.py -k "other_algorithms and EAGLE3"
lane spec_nextn $T/test_e2e_speculative_gpu.py -k "other_algorithms and NEXTN"
if [ ${#pids[@]} -eq 0 ]; then echo "gpu_lanes: no lane named in: $*" >&2; exit 2; fi
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
tail -n 2 "$out"/*.log
exit "$rc"
