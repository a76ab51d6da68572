#!/usr/bin/env bash
# The whole GPU suite on one GPU, as lanes derived from the test files' register_cuda_ci
# declarations (test/gpu_lanes.py; docs/architecture.md, "Tests"). On the device machine, from
# the repository root, after the bundles are installed:
#   bash test/gpu_lanes.sh                  # every lane; one line per lane, then all together
#   bash test/gpu_lanes.sh e2e_swa_gpu hicache_mla   # only the lanes named (--list: the names)
# Exit status: 0 only if every lane passed.
exec python3 "$(dirname "$0")/gpu_lanes.py" "$@"
