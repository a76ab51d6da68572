#!/usr/bin/env bash
# The extra device bundle the GPU suite's NSA lane needs (docs/testing.md, "The CPU suite"):
# FlashMLA's ops from the sglang-kernel wheel (bundle b drops them), sgl-deep-gemm and einops
# (NSA's indexer). Run on the development machine, from the repository root, after
# `bash ../shared/device/bundle.sh`:
#   bash test/device_bundle_nsa.sh          # writes .device/d (git-ignored, under 64 MB)
# On the GPU machine, after `. .device/a/setup.sh` (carry .device/d with bundle c):
#   bash .device/d/install.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
. test/device_wheels.sh
device_download .device/d sgl-deep-gemm==0.1.0 einops==0.8.2
ls .device/.cache/sglang_kernel-0.4.2.post2-*.whl >/dev/null 2>&1 \
  || device_download .device/.cache sglang-kernel==0.4.2.post2
unzip -o -q -j .device/.cache/sglang_kernel-0.4.2.post2-*.whl 'sgl_kernel/flashmla_ops.abi3.so' \
  -d .device/d
cat > .device/d/install.sh <<'EOS'
# from the repository root on the GPU machine, after . .device/a/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .device/d/*.whl && cp .device/d/flashmla_ops.abi3.so /tmp/site/sgl_kernel/
EOS
du -sh .device/d
