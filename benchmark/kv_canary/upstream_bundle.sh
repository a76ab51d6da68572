#!/usr/bin/env bash
# sglang 0.5.17 (the newest release on the GPU machines' torch 2.11, with upstream's own
# kv_canary) for a GPU machine without a package index, in its own site directory, to run it
# beside this project as a black box (benchmark/results/, "side by side with upstream").
# Run on the development machine, from the repository root, after ../shared/device/bundle.sh:
#   bash benchmark/kv_canary/upstream_bundle.sh      # writes .device/up_a, up_b, up_c (< 64 MB each)
# On the GPU machine (bundles a, c of 0.5.12 installed in /tmp/site first: the shared deps):
#   bash .device/up_a/install.sh; bash .device/up_b/install.sh; bash .device/up_c/install.sh
#   (one call each, carrying each)
#   PYTHONPATH=benchmark/kv_canary/upstream_site:/tmp/site_up:/tmp/site \
#     python3 -m sglang.launch_server ...   # 0.5.17 first; upstream_site keeps this project out
# Never install it beside this project: 0.5.17 ships its own sglang.srt.kv_canary.
# What 0.5.17 changes against 0.5.12's bundles: sglang itself, transformers 5.12.1,
# apache-tvm-ffi 0.1.11 (its canary kernels compile at first use through tvm-ffi and nvcc),
# flashinfer-python 0.6.15.post1, sglang-kernel 0.4.5 (slimmed as bundle b slims 0.4.2.post2:
# no FA3 / FlashMLA / sm100 / InfLLM payloads), the new pure deps xxhash, zstandard, distro, and
# xgrammar 0.2.1 (its server_args imports it at start-up; 0.5.12's bundles have none: a
# 0.5.17 server stopped on it, H100, 2026-11-26).
# Its other new pins (helion, humming-kernels, numba, tilelang, nvidia-mathdx, a newer
# sgl-deep-gemm) are left out until a dense dummy-weight server is seen importing them.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
. test/device_wheels.sh
device_download .device/up_a sglang==0.5.17 transformers==5.12.1 apache-tvm-ffi==0.1.11 xxhash==4.1.0 \
  zstandard==0.25.0 distro==1.9.0
device_download .device/up_b flashinfer-python==0.6.15.post1
device_download .device/up_c xgrammar==0.2.1
if [ ! -f .device/up_b/sgl_kernel_slim.tgz ]; then
  ls .device/.cache/sglang_kernel-0.4.5-*.whl >/dev/null 2>&1 || device_download .device/.cache sglang-kernel==0.4.5
  tmp=$(mktemp -d)
  (cd "$tmp" && unzip -q "$root"/.device/.cache/sglang_kernel-0.4.5-*.whl \
     && rm -f sgl_kernel/flash_ops.abi3.so sgl_kernel/flashmla_ops.abi3.so \
              sgl_kernel/infllm_ops.*.so && rm -rf sgl_kernel/sm100 \
     && tar czf "$root/.device/up_b/sgl_kernel_slim.tgz" sgl_kernel triton_kernels sglang_kernel-*.dist-info)
  rm -rf "$tmp"
fi
for d in up_a up_b up_c; do
  cat > .device/$d/install.sh <<EOS
# on the GPU machine, from the repository root: installs this folder into /tmp/site_up
set -e
mkdir -p /tmp/site_up
if ls .device/$d/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
    --target /tmp/site_up .device/$d/*.whl
fi
if [ -f .device/$d/sgl_kernel_slim.tgz ]; then tar xzf .device/$d/sgl_kernel_slim.tgz -C /tmp/site_up; fi
EOS
done
du -sh .device/up_a .device/up_b .device/up_c
