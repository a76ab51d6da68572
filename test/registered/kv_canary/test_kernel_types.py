"""Layout of the kernel package: types without Triton, derived record size, re-exports, no
import cycles, named kernel constants, and "validate once" launchers.

- ``types`` / ``validation`` / ``_checks`` (and the torch references) import without Triton.
- ``CANARY_SLOT_BYTES`` is derived from the record's field count.
- The documented import paths (``verify``, ``write``, the package) re-export the very objects
  of ``types``.
- No file-level import cycle inside ``sglang.jit_kernel.kv_canary``.
- The ``tl.constexpr`` twins in ``_kernel_consts`` equal ``consts``.
- Every public launcher and every public torch reference validates its arguments exactly once
  (the launchers' CPU path calls the unvalidated ``run_*`` reference), and a bad argument
  raises the same error through the launcher as through the reference.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from canary_testlib import make_context

import sglang.jit_kernel.kv_canary as pkg
from sglang.jit_kernel.kv_canary import (
    _kernel_consts,
    consts,
    plan_ref,
    scatter_req_token_ids,
    types,
    validation,
    verify,
    verify_ref,
    write,
    write_ref,
)
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="stage-a-test-cpu")

PKG_DIR = os.path.dirname(os.path.abspath(pkg.__file__))
PKG_NAME = "sglang.jit_kernel.kv_canary"
I32, I64 = torch.int32, torch.int64


# =============================================================================================
# Record size, re-exports, kernel constants
# =============================================================================================


def test_canary_slot_bytes_is_derived_from_the_field_count():
    assert consts.CANARY_FIELD_BYTES == 8
    assert types.CANARY_SLOT_BYTES == consts.CANARY_NUM_FIELDS * 8 == 32
    assert types.CANARY_SLOT_BYTES == consts.CANARY_NUM_FIELDS * consts.CANARY_FIELD_BYTES
    assert verify.CANARY_SLOT_BYTES == pkg.CANARY_SLOT_BYTES == types.CANARY_SLOT_BYTES


VERIFY_REEXPORTS = (
    "CANARY_SLOT_BYTES",
    "CanaryLaunchTag",
    "CanaryPhase",
    "KvHalf",
    "PoolKind",
    "NUM_CANARY_LAUNCH_TAGS",
    "RealKvSource",
    "VerifyOrWriteContext",
    "VerifyPlan",
)


@pytest.mark.parametrize("name", VERIFY_REEXPORTS)
def test_verify_reexports_types(name):
    assert getattr(verify, name) is getattr(types, name)
    assert name in verify.__all__


@pytest.mark.parametrize("name", ("WritePlan", "WriteParts"))
def test_write_reexports_types(name):
    assert getattr(write, name) is getattr(types, name)
    assert name in write.__all__


def test_package_exports_types():
    for name in (
        "CANARY_SLOT_BYTES",
        "CanaryLaunchTag",
        "CanaryPhase",
        "KvHalf",
        "PoolKind",
        "RealKvSource",
        "VerifyOrWriteContext",
        "VerifyPlan",
        "WriteParts",
        "WritePlan",
    ):
        assert getattr(pkg, name) is getattr(types, name), name
        assert name in pkg.__all__
    for name in pkg.__all__:
        assert hasattr(pkg, name), name


def test_kernel_consts_equal_consts():
    k, c = _kernel_consts, consts
    fail = c.FailReason
    pairs = {
        "FAIL_VERIFY_CHAIN": fail.VERIFY_CHAIN_HASH_MISMATCH,
        "FAIL_VERIFY_POSITION": fail.VERIFY_POSITION_MISMATCH,
        "FAIL_VERIFY_REAL_KV": fail.VERIFY_REAL_KV_HASH_MISMATCH,
        "FAIL_WRITE_TOKEN": fail.WRITE_TOKEN_MISMATCH,
        "FAIL_WRITE_POSITION": fail.WRITE_POSITION_MISMATCH,
        "FAIL_VERIFY_TOKEN": fail.VERIFY_TOKEN_MISMATCH,
        "FIELD_TOKEN": c.CANARY_FIELD_TOKEN,
        "FIELD_POSITION": c.CANARY_FIELD_POSITION,
        "FIELD_PREV_HASH": c.CANARY_FIELD_PREV_HASH,
        "FIELD_REAL_KV_HASH": c.CANARY_FIELD_REAL_KV_HASH,
        "RECORD_WORDS": c.CANARY_NUM_FIELDS,
        "VIOL_KERNEL_KIND": c.VIOLATION_FIELD_KERNEL_KIND,
        "VIOL_SLOT_IDX": c.VIOLATION_FIELD_SLOT_IDX,
        "VIOL_POSITION": c.VIOLATION_FIELD_POSITION,
        "VIOL_STORED_TOKEN": c.VIOLATION_FIELD_STORED_TOKEN,
        "VIOL_EXPECTED_TOKEN": c.VIOLATION_FIELD_EXPECTED_TOKEN,
        "VIOL_STORED_CHAIN_HASH": c.VIOLATION_FIELD_STORED_CHAIN_HASH,
        "VIOL_EXPECTED_AUX": c.VIOLATION_FIELD_EXPECTED_AUX,
        "VIOL_FAIL_REASON_BITS": c.VIOLATION_FIELD_FAIL_REASON_BITS,
        "VIOL_READ_POSITION": c.VIOLATION_FIELD_READ_POSITION,
        "VIOL_REQ_TO_TOKEN_ROW": c.VIOLATION_FIELD_REQ_TO_TOKEN_ROW,
        "VIOLATION_WORDS": c.VIOLATION_NUM_FIELDS,
        "NO_PREV_SLOT": c.NO_PREV_SLOT,
        "NO_EXPECTED_TOKEN": c.NO_EXPECTED_TOKEN,
        "NO_SEED_SLOT": c.NO_SEED_SLOT,
        "NO_REQ_TO_TOKEN_ROW": c.NO_REQ_TO_TOKEN_ROW,
        "CHAIN_ANCHOR": c.CANARY_CHAIN_ANCHOR,
        "SPLITMIX_MUL1": c.SPLITMIX64_MUL1,
        "SPLITMIX_MUL2": c.SPLITMIX64_MUL2,
        "SRC_DESC_PTR": c.REAL_KV_DESC_PTR,
        "SRC_DESC_ROW_STRIDE": c.REAL_KV_DESC_ROW_STRIDE,
        "SRC_DESC_PAGE_SIZE": c.REAL_KV_DESC_PAGE_SIZE,
        "SRC_DESC_WORDS_PER_TOKEN": c.REAL_KV_DESC_WORDS_PER_TOKEN,
        "SRC_DESC_NUM_WORDS": c.REAL_KV_DESC_NUM_WORDS,
        "SRC_DESC_WORDS": c.REAL_KV_DESC_WORDS,
        "DESC_LAYER": c.DEEP_DESC_LAYER,
        "DESC_HALF": c.DEEP_DESC_HALF,
        "DESC_WORDS": c.DEEP_DESC_WORDS,
    }
    import triton.language as tl

    for name, want in pairs.items():
        got = getattr(k, name)
        assert isinstance(got, tl.constexpr), name
        assert got.value == int(want), name


def test_the_context_packs_its_sources_once_into_one_descriptor_tensor():
    """The kernels read a context's real-KV sources through ``source_descriptors`` (one launch
    argument), built with the context on its device."""
    kv = torch.zeros(8, 48, dtype=I64)
    a = types.RealKvSource(tensor=kv, page_size=2, num_bytes_per_token=64, read_bytes=48)
    b = types.RealKvSource(tensor=kv[:, 32:], page_size=4, num_bytes_per_token=32, read_bytes=32)
    ctx = make_context(16, device="cpu", sources=(a, b), mode=consts.RealKvHashMode.ALL)
    desc = ctx.source_descriptors
    c = consts
    assert desc.dtype == I64 and desc.device == ctx.device
    assert desc.shape == (c.REAL_KV_MAX_SOURCES, c.REAL_KV_DESC_WORDS)
    rows = desc.tolist()
    for row, src, words in ((rows[0], a, 6), (rows[1], b, 4)):
        assert row[c.REAL_KV_DESC_PTR] == src.words_view.data_ptr()
        assert row[c.REAL_KV_DESC_ROW_STRIDE] == src.row_stride_words == 48
        assert row[c.REAL_KV_DESC_PAGE_SIZE] == src.page_size
        assert row[c.REAL_KV_DESC_WORDS_PER_TOKEN] == src.num_words_per_token
        assert row[c.REAL_KV_DESC_NUM_WORDS] == words
    for row in rows[2:]:  # past the sources: never read, nothing to fold
        assert row[c.REAL_KV_DESC_PAGE_SIZE] == 1 and row[c.REAL_KV_DESC_NUM_WORDS] == 0


# =============================================================================================
# No Triton in the types, no import cycles
# =============================================================================================

TRITON_FREE = (
    "_checks",
    "types/__init__",
    "types/tags",
    "types/context",
    "types/plans",
    "types/deep",
    "validation",
    "consts",
    "verify_ref",
    "write_ref",
    "plan_ref",
    "_hash_torch",
    "_ring_torch",
)


def _imported_names(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or ""


@pytest.mark.parametrize("module", TRITON_FREE)
def test_module_has_no_triton_import_statement(module):
    names = list(_imported_names(os.path.join(PKG_DIR, module + ".py")))
    assert not [n for n in names if n == "triton" or n.startswith("triton.")], names


def test_types_and_references_import_without_triton():
    """With ``triton`` unimportable and the parent packages' inits skipped (sglang's own init
    imports Triton), the types, validators and torch references still import."""
    python_root = os.path.dirname(os.path.dirname(os.path.dirname(PKG_DIR)))
    script = textwrap.dedent(f"""
        import sys, types as pytypes
        root = {python_root!r}
        for name in ("sglang", "sglang.jit_kernel", "sglang.jit_kernel.kv_canary"):
            m = pytypes.ModuleType(name)
            m.__path__ = [root + "/" + name.replace(".", "/")]
            sys.modules[name] = m

        class BlockTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton is blocked in this test")

        sys.meta_path.insert(0, BlockTriton())
        for mod in {TRITON_FREE!r}:
            __import__("sglang.jit_kernel.kv_canary." + mod.replace("/__init__", "").replace("/", "."))
        assert not [k for k in sys.modules if k == "triton" or k.startswith("triton.")]
        print("OK")
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-4000:]


def _import_graph():
    """Module -> modules of this package it imports at file level.

    ``from pkg import name`` where ``name`` is a submodule is an import of that submodule;
    importing ``a.b.c`` also imports every package ``__init__`` on the way inside this package,
    except the importer's own ancestors (already initialising when it runs)."""
    mods = {}
    for d, _, files in os.walk(PKG_DIR):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), PKG_DIR)[:-3].replace(os.sep, ".")
                name = PKG_NAME if rel == "__init__" else PKG_NAME + "." + rel
                name = name[: -len(".__init__")] if name.endswith(".__init__") else name
                mods[name] = os.path.join(d, f)
    depth = PKG_NAME.count(".") + 1

    def ancestors(m):
        parts = m.split(".")
        return [".".join(parts[:i]) for i in range(depth, len(parts))]

    graph = {}
    for m, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        own = set(ancestors(m)) | {m}
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    cur = m if is_pkg else m.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        cur = cur.rsplit(".", 1)[0]
                    base = cur + ("." + base if base else "")
                for a in node.names:
                    sub = base + "." + a.name
                    targets.add(sub if sub in mods else base)
        graph[m] = {
            x
            for t in targets
            if t in mods
            for x in ancestors(t) + [t]
            if x in mods and x not in own
        }
    return graph


def test_no_import_cycles():
    graph = _import_graph()
    assert f"{PKG_NAME}.plan_ref" in graph and f"{PKG_NAME}.plan.api" in graph
    state = {}  # 1 = on the stack, 2 = done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n) :] + [n]
                pytest.fail(
                    "import cycle: "
                    + " -> ".join(c[len(PKG_NAME) + 1 :] or "__init__" for c in cycle)
                )
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


# =============================================================================================
# Validate once
# =============================================================================================


def _calls(device):
    """(kind, public launcher, public reference, unvalidated run_* name on its module, module,
    validator name, kwargs factory) for an accepted call of each launcher on ``device``."""
    from sglang.jit_kernel.kv_canary import VerifyPlan, WritePlan

    def plan_kwargs():
        return dict(
            verify_plan_out=VerifyPlan.allocate(verify_capacity=16, device=device),
            write_plan_out=WritePlan.allocate(write_req_capacity=4, device=device),
            req_pool_indices=torch.tensor([1, 2], dtype=I64, device=device),
            prefix_lens=torch.tensor([1, 2], dtype=I32, device=device),
            extend_seq_lens=torch.tensor([1, 1], dtype=I64, device=device),
            req_to_token=torch.arange(1, 25, dtype=I32, device=device).reshape(3, 8),
            swa_window_size=0,
            full_to_swa_index_mapping=None,
            verify_capacity=16,
            req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0,
        )

    def write_kwargs():
        return dict(
            context=make_context(16, device=device),
            plan=WritePlan.allocate(write_req_capacity=2, device=device),
            input_ids=torch.tensor([5, 6, 7], dtype=I64, device=device),
            positions=torch.tensor([0, 1, 2], dtype=I64, device=device),
            out_cache_loc=torch.tensor([1, 2, 3], dtype=I64, device=device),
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )

    def verify_kwargs():
        return dict(
            context=make_context(16, device=device),
            plan=VerifyPlan.allocate(verify_capacity=4, device=device),
            check_verify_expected_token=False,
        )

    def scatter_kwargs():
        return dict(
            flat_in=torch.tensor([1, 2, 3], dtype=I64, device=device),
            offsets=torch.tensor([0, 2, 3], dtype=I64, device=device),
            req_pool_indices=torch.tensor([1, 2], dtype=I64, device=device),
            pool_out=torch.zeros(3, 4, dtype=I32, device=device),
        )

    def packed_scatter_kwargs():
        return dict(
            packed=torch.tensor([2, 3, 0, 0, 1, 1, 2, 7, 8, 9], dtype=I64, device=device),
            req_pool_indices=torch.tensor([1, 2, 0], dtype=I64, device=device),
            pool_out=torch.zeros(3, 4, dtype=I32, device=device),
            valid_lens_out=torch.zeros(3, dtype=I64, device=device),
        )

    return {
        "packed_scatter": (
            pkg.launch_scatter_packed_token_ids_kernel,
            pkg.scatter_packed_token_ids_torch_reference,
            scatter_req_token_ids,
            "run_scatter_packed_token_ids_reference",
            "validate_packed_scatter_args",
            packed_scatter_kwargs,
        ),
        "plan": (
            pkg.launch_canary_plan_kernels,
            pkg.launch_canary_plan_kernels_torch_reference,
            plan_ref,
            "run_canary_plan_reference",
            "validate_plan_args",
            plan_kwargs,
        ),
        "write": (
            pkg.launch_canary_write_kernel,
            pkg.launch_canary_write_kernel_torch_reference,
            write_ref,
            "run_canary_write_reference",
            "validate_write_args",
            write_kwargs,
        ),
        "verify": (
            pkg.launch_canary_verify_kernel,
            pkg.launch_canary_verify_kernel_torch_reference,
            verify_ref,
            "run_canary_verify_reference",
            "validate_verify_args",
            verify_kwargs,
        ),
        "scatter": (
            pkg.launch_scatter_req_token_ids_kernel,
            pkg.scatter_req_token_ids_torch_reference,
            scatter_req_token_ids,
            "run_scatter_req_token_ids_reference",
            "validate_scatter_args",
            scatter_kwargs,
        ),
    }


KINDS = ("plan", "write", "verify", "scatter", "packed_scatter")


class _ValidatorCallCounter:
    """Counts calls of any function named ``validate*`` / ``_validate*`` defined in this package,
    however it is imported or looked up (a profile hook on code objects, not a patch)."""

    def __init__(self):
        self.calls = []
        self._old = None

    def _hook(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_name.lstrip("_").startswith("validate") and os.path.abspath(
                code.co_filename
            ).startswith(PKG_DIR + os.sep):
                self.calls.append(code.co_name)

    def __enter__(self):
        self._old = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._old)


@pytest.mark.parametrize("kind", KINDS)
def test_public_launcher_validates_once_on_the_reference_path(kind, reference_kernels_on_cpu):
    launcher, _, _, _, _, make_kwargs = _calls(torch.device("cpu"))[kind]
    kwargs = make_kwargs()
    with _ValidatorCallCounter() as counter:
        launcher(**kwargs)
    assert len(counter.calls) == 1, counter.calls


@pytest.mark.parametrize("kind", KINDS)
def test_public_launcher_validates_once_on_the_triton_path(kind, device):
    from sglang.jit_kernel.kv_canary import _launch

    if not _launch.use_triton(device):
        pytest.skip("no Triton path for CPU tensors without TRITON_INTERPRET")
    launcher, _, _, _, _, make_kwargs = _calls(device)[kind]
    kwargs = make_kwargs()
    with _ValidatorCallCounter() as counter:
        launcher(**kwargs)
    assert len(counter.calls) == 1, counter.calls


@pytest.mark.parametrize("kind", KINDS)
def test_public_reference_validates_once(kind):
    _, reference, _, _, _, make_kwargs = _calls(torch.device("cpu"))[kind]
    with _ValidatorCallCounter() as counter:
        reference(**make_kwargs())
    assert len(counter.calls) == 1, counter.calls


@pytest.mark.parametrize("kind", KINDS)
def test_launcher_goes_through_validation_then_unvalidated_reference(
    kind, reference_kernels_on_cpu, monkeypatch
):
    """The CPU path: ``validation.<validator>`` once, then the module's ``run_*`` (both looked
    up at call time), never the public (validating) reference."""
    launcher, reference, ref_module, run_name, validator, make_kwargs = _calls(torch.device("cpu"))[
        kind
    ]
    seen = []
    real_validator = getattr(validation, validator)
    real_run = getattr(ref_module, run_name)

    def count_validator(*args, **kwargs):
        seen.append("validate")
        return real_validator(*args, **kwargs)

    def count_run(**kwargs):
        seen.append("run")
        return real_run(**kwargs)

    monkeypatch.setattr(validation, validator, count_validator)
    monkeypatch.setattr(ref_module, run_name, count_run)
    launcher(**make_kwargs())
    assert seen == ["validate", "run"]
    seen.clear()
    reference(**make_kwargs())
    assert seen == ["validate", "run"]


BAD_ARGS = {
    "plan": (dict(swa_window_size=-1), ValueError, "swa_window_size must be >= 0, got -1"),
    "write": (
        dict(input_ids=torch.tensor([5.0, 6.0, 7.0])),
        TypeError,
        "input_ids must have dtype int32 or int64, got torch.float32",
    ),
    "verify": (dict(plan=object()), TypeError, "plan must be a VerifyPlan, got object"),
    "scatter": (
        dict(pool_out=torch.zeros(3, 4, dtype=I64)),
        TypeError,
        "pool_out must have dtype int32, got torch.int64",
    ),
    "packed_scatter": (
        dict(packed=torch.tensor([0, 0, 0], dtype=I64)),
        ValueError,
        "packed has 3 words, fewer than the header of 3 requests (10 words)",
    ),
}


@pytest.mark.parametrize("path", ("triton", "reference"))
@pytest.mark.parametrize("kind", KINDS)
def test_bad_argument_raises_the_same_error_through_launcher_and_reference(kind, path, monkeypatch):
    from sglang.jit_kernel.kv_canary import _launch

    monkeypatch.setattr(_launch, "TRITON_INTERPRET", path == "triton")
    launcher, reference, _, _, _, make_kwargs = _calls(torch.device("cpu"))[kind]
    over, exc, message = BAD_ARGS[kind]
    errors = []
    for fn in (launcher, reference):
        kwargs = make_kwargs()
        kwargs.update(over)
        with pytest.raises(exc) as info:
            fn(**kwargs)
        errors.append(str(info.value))
        ctx = kwargs.get("context")
        if ctx is not None:
            assert int(ctx.kernel_run_counter[0]) == 0  # rejected before any work
    assert errors == [message, message]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
