#!/usr/bin/env bash
# The extra device bundles a prefill/decode (PD) disaggregated pair of sglang 0.5.12 servers
# needs on one GPU machine (benchmark/kv_canary/pd_one_gpu.py): a real KV transfer engine.
# Run on the development machine, from the repository root, after `bash ../shared/device/bundle.sh`:
#   bash test/device_bundle_pd.sh        # writes .device/pd_a, pd_b, pd_c (git-ignored, each < 64 MiB)
#
#   .device/pd_a  Mooncake transfer engine (mooncake-transfer-engine-cuda13 0.3.14), slimmed to
#                 `mooncake.engine` (the TransferEngine sglang's mooncake backend imports), plus
#                 the system libraries the wheel leaves out (libibverbs, libmlx5, libnuma, libcurl:
#                 manylinux builds taken from the nixl-cu13 wheel) and, used only where the machine
#                 lacks them, Debian 12's libssl.so.3 / libcrypto.so.3 (libcurl's)
#   .device/pd_b  NIXL (nixl 1.5.1 + nixl-cu13 1.5.1), slimmed to the Python API, libnixl, the UCX
#                 plugin and UCX with its cuda/cma transports
#   .device/pd_c  sglang-router 0.3.2 (Rust router + mini_lb; optional: pd_one_gpu.py speaks the
#                 bootstrap protocol itself when the router is absent)
#
# On the GPU machine, from the repository root, after `. .device/a/setup.sh` (bundles a, b, c):
#   bash .device/pd_a/install.sh; bash .device/pd_b/install.sh; bash .device/pd_c/install.sh
# Each folder travels in its own `run` call or beside others while the call's carry stays under
# 64 MiB; everything lands in /tmp/site (PYTHONPATH=/tmp/site), which outlives a call on a warm
# machine. Every install.sh ends with an import check that prints OK or the error.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
. test/device_wheels.sh

MOONCAKE=mooncake-transfer-engine-cuda13==0.3.14
NIXL_META=nixl==1.5.1
NIXL=nixl-cu13==1.5.1
ROUTER=sglang-router==0.3.2
CACHE=.device/.cache/pd
mkdir -p "$CACHE" .device/pd_a .device/pd_b .device/pd_c

have() { ls "$CACHE"/"$1" >/dev/null 2>&1; }
have 'mooncake_transfer_engine_cuda13-0.3.14-*.whl' || device_download "$CACHE" "$MOONCAKE"
have 'nixl-1.5.1-*.whl' || device_download "$CACHE" "$NIXL_META"
have 'nixl_cu13-1.5.1-*.whl' || device_download "$CACHE" "$NIXL"
have 'sglang_router-0.3.2-*.whl' || device_download "$CACHE" "$ROUTER"
if ! have 'libssl3_*_amd64.deb'; then
  (cd "$CACHE" && apt-get download libssl3 >/dev/null 2>&1) \
    || { echo "device_bundle_pd.sh: could not download Debian's libssl3" >&2; exit 1; }
fi

# slim WHEEL... -> TGZ: unzip the wheels, keep every non-ELF file and the ELF files reachable
# (DT_NEEDED, by file name inside the wheels) from the seeds, drop the dropped paths, add the
# extra files/links, tar the rest (extracted as is into /tmp/site on the GPU machine).
slim() {
  python3 - "$@" <<'PY'
import fnmatch, json, os, pathlib, shutil, subprocess, sys, tarfile, tempfile, zipfile
spec = json.loads(sys.argv[1])
tmp = pathlib.Path(tempfile.mkdtemp())
try:
    for whl in spec["wheels"]:
        with zipfile.ZipFile(whl) as z:
            z.extractall(tmp)
    files = [p for p in tmp.rglob("*") if p.is_file()]
    rel = lambda p: str(p.relative_to(tmp))
    for pat in spec.get("drop", []):
        for p in files:
            if p.exists() and fnmatch.fnmatch(rel(p), pat):
                p.unlink()
    for d in spec.get("drop_dirs", []):
        shutil.rmtree(tmp / d, ignore_errors=True)
    files = [p for p in tmp.rglob("*") if p.is_file()]
    is_elf = lambda p: p.open("rb").read(4) == b"\x7fELF"
    elves = [p for p in files if is_elf(p)]
    by_name = {}
    for p in elves:
        by_name.setdefault(p.name, p)
    def needed(p):
        out = subprocess.run(["readelf", "-d", str(p)], capture_output=True, text=True).stdout
        return [l.split("[", 1)[1].split("]", 1)[0] for l in out.splitlines() if "(NEEDED)" in l]
    keep, todo = set(), []
    for pat in spec["seeds"]:
        hits = [p for p in elves if fnmatch.fnmatch(rel(p), pat)]
        if not hits:
            sys.exit(f"slim: no ELF file matches seed {pat}")
        todo += hits
    while todo:
        p = todo.pop()
        if p in keep:
            continue
        keep.add(p)
        todo += [by_name[n] for n in needed(p) if n in by_name]
    for p in elves:
        if p not in keep:
            p.unlink()
    for src_wheel, member, dest in spec.get("extra", []):
        with zipfile.ZipFile(src_wheel) as z:
            data = z.read(member)
        (tmp / dest).parent.mkdir(parents=True, exist_ok=True)
        (tmp / dest).write_bytes(data)
        (tmp / dest).chmod(0o755)
    for link, target in spec.get("links", []):
        (tmp / link).symlink_to(target)
    for extra_dir in spec.get("extra_dirs", []):  # [host dir, dest dir]
        shutil.copytree(extra_dir[0], tmp / extra_dir[1], dirs_exist_ok=True)
    # empty directories left by the drops
    for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    out = pathlib.Path(spec["out"])
    with tarfile.open(str(out) + ".tmp", "w:gz") as t:
        for p in sorted(tmp.iterdir()):
            t.add(p, arcname=p.name)
    os.replace(str(out) + ".tmp", out)
    kept = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"slim: {out} {out.stat().st_size/2**20:.1f} MiB ({kept/2**20:.1f} MiB unpacked, "
          f"{len(keep)} ELF files kept)")
finally:
    shutil.rmtree(tmp)
PY
}

MC_WHL=$(ls "$CACHE"/mooncake_transfer_engine_cuda13-0.3.14-*.whl)
NX_WHL=$(ls "$CACHE"/nixl_cu13-1.5.1-*.whl)
NXM_WHL=$(ls "$CACHE"/nixl-1.5.1-*.whl)

# ---- pd_a: Mooncake --------------------------------------------------------------------------
if [ ! -f .device/pd_a/mooncake_slim.tgz ]; then
  # engine.so (RPATH $ORIGIN:$ORIGIN/../mooncake_transfer_engine_cuda13.libs) and libasio.so
  # (RUNPATH $ORIGIN) need libibverbs.so.1, libmlx5.so.1, libnuma.so.1 and libcurl.so.4 from the
  # system: the manylinux copies from nixl-cu13 (RPATH $ORIGIN each) go into mooncake/ under
  # their own names, with the plain names as links.
  L=nixl_cu13.libs
  extra=(); links=()
  for pair in libibverbs-1de1263b.so.1.14.48.0:libibverbs.so.1 libmlx5-79ef1d27.so.1.24.48.0:libmlx5.so.1 \
              libnuma-3387f5e3.so.1.0.0:libnuma.so.1 libcurl-6afc9505.so.4.8.0:libcurl.so.4 \
              libnl-3-47cd035c.so.200.26.0: libnl-route-3-3ad497a3.so.200.26.0: libzstd-76b78bac.so.1.4.4:; do
    f=${pair%%:*}; plain=${pair#*:}
    extra+=("[\"$NX_WHL\", \"$L/$f\", \"mooncake/$f\"]")
    [ -n "$plain" ] && links+=("[\"mooncake/$plain\", \"$f\"]")
  done
  spec=$(printf '{"wheels": ["%s"], "out": ".device/pd_a/mooncake_slim.tgz",
    "seeds": ["mooncake/engine.so", "mooncake/nvlink_allocator.so", "mooncake/_fast_copy*.so"],
    "drop": ["mooncake/mooncake_client", "mooncake/mooncake_master", "mooncake/transfer_engine_bench"],
    "extra": [%s], "links": [%s]}' "$MC_WHL" "$(IFS=,; echo "${extra[*]}")" "$(IFS=,; echo "${links[*]}")")
  slim "$spec"
fi
if [ ! -f .device/pd_a/openssl3_fallback.tgz ]; then
  tmp=$(mktemp -d)
  dpkg -x "$(ls "$CACHE"/libssl3_*_amd64.deb | head -1)" "$tmp/x"
  tar czf .device/pd_a/openssl3_fallback.tgz -C "$tmp/x/usr/lib/x86_64-linux-gnu" libssl.so.3 libcrypto.so.3
  rm -rf "$tmp"
fi
cat > .device/pd_a/install.sh <<'EOS'
# On the GPU machine, from the repository root, after `. .device/a/setup.sh`:
#   bash .device/pd_a/install.sh     (Mooncake's TransferEngine into /tmp/site)
mkdir -p /tmp/site
tar xzf .device/pd_a/mooncake_slim.tgz -C /tmp/site || exit 1
# libcurl.so.4 needs libssl.so.3 / libcrypto.so.3: the machine's when it has them, else Debian 12's
if ! python3 -c "import ctypes; ctypes.CDLL('libssl.so.3'); ctypes.CDLL('libcrypto.so.3')" 2>/dev/null; then
  echo "pd_a: no libssl.so.3 on this machine: using the bundled Debian 12 copy"
  tar xzf .device/pd_a/openssl3_fallback.tgz -C /tmp/site/mooncake || exit 1
fi
PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 -c "
import torch  # loads libcudart.so.13, which mooncake/engine.so needs
from mooncake.engine import TransferEngine
TransferEngine()
print('pd_a: mooncake.engine OK')" 2>&1 | tail -5
exit 0
EOS

# ---- pd_b: NIXL -------------------------------------------------------------------------------
if [ ! -f .device/pd_b/nixl_slim.tgz ]; then
  # libnixl.so finds its plugins next to itself (dladdr): .nixl_cu13.mesonpy.libs/plugins; UCX
  # finds its transport modules in nixl_cu13.libs/ucx (next to libucs).
  spec=$(printf '{"wheels": ["%s", "%s"], "out": ".device/pd_b/nixl_slim.tgz",
    "seeds": ["nixl_cu13/_bindings*.so", "nixl_cu13/_utils*.so", ".nixl_cu13.mesonpy.libs/libnixl.so",
              ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so", "nixl_cu13.libs/ucx/libuct_cuda.so*",
              "nixl_cu13.libs/ucx/libucm_cuda.so*", "nixl_cu13.libs/ucx/libuct_cma.so*"],
    "drop": ["nixl_cu13.libs/nixl/*", "nixl_cu13.libs/ucx/*.la",
             ".nixl_cu13.mesonpy.libs/plugins/libplugin_[!U]*",
             ".nixl_cu13.mesonpy.libs/plugins/libtelemetry_*",
             ".nixl_cu13.mesonpy.libs/plugins/libtrace_*"],
    "drop_dirs": ["nixl_ep_cu13", "nixl_ep", "nixl_cu13.scripts", "nixl_cu13-1.5.1.data"]}' \
    "$NXM_WHL" "$NX_WHL")
  slim "$spec"
fi
cat > .device/pd_b/install.sh <<'EOS'
# On the GPU machine, from the repository root, after `. .device/a/setup.sh`:
#   bash .device/pd_b/install.sh     (NIXL with its UCX plugin into /tmp/site)
mkdir -p /tmp/site
tar xzf .device/pd_b/nixl_slim.tgz -C /tmp/site || exit 1
PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 -c "
import torch, uuid
from nixl._api import nixl_agent, nixl_agent_config
a = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[]))
print('pd_b: nixl OK, plugins', a.get_plugin_list())" 2>&1 | tail -5
exit 0
EOS

# ---- pd_c: sglang-router ---------------------------------------------------------------------
cp -f "$CACHE"/sglang_router-0.3.2-*.whl .device/pd_c/
cat > .device/pd_c/install.sh <<'EOS'
# On the GPU machine, from the repository root, after `. .device/a/setup.sh`:
#   bash .device/pd_c/install.sh     (sglang-router 0.3.2 into /tmp/site; optional)
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .device/pd_c/*.whl || exit 1
PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 -c "
import sglang_router.launch_router, sglang_router.router
print('pd_c: sglang_router OK')" 2>&1 | tail -5
exit 0
EOS

du -sh .device/pd_a .device/pd_b .device/pd_c
