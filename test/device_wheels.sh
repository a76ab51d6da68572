# Sourced by the device bundle scripts (test/device_bundle_nsa.sh,
# benchmark/kv_canary/upstream_bundle.sh): download wheels, on the development machine, for
# the GPU machines' Python 3.12 on x86-64, without their dependencies.
#   device_download DIR PKG==VERSION...   (stops the script, naming the package, on failure)
DEVICE_WHEEL_PLATFORMS="--only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"

device_download() {
  local dir=$1; shift
  mkdir -p "$dir"
  for p in "$@"; do
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps $DEVICE_WHEEL_PLATFORMS -d "$dir" "$p" \
      || { echo "$(basename "$0"): could not download $p" >&2; exit 1; }
  done
}
