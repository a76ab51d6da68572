"""The project's layering, read from the source tree (docs/architecture.md, "Layers").

Each module belongs to exactly one layer; a module may import from its own layer and the
layers below it, never from one above. No import cycle between files. Only the sglang seam
(and the tool on top: the demo and its server harness) import sglang beyond the two kv_canary
packages. The runtime takes nothing but ``launch_*`` functions from the kernel files
``verify.py`` / ``write.py`` (their types live in ``types.py``).

The checks run on the tree the tests were collected from (``python/`` next to ``test/``), and
each check is also run on a small planted tree to show it fails when it should.
"""

from __future__ import annotations

import pathlib
import sys
import textwrap

import pytest

from import_graph import ImportGraph, Layer, assign_layers, layer_violations
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")

REPO = pathlib.Path(__file__).resolve().parents[3]
SOURCE_ROOT = REPO / "python"
RUNTIME = "sglang.srt.kv_canary"
KERNELS = "sglang.jit_kernel.kv_canary"
PACKAGES = (RUNTIME, KERNELS)


def _l(name: str, *patterns: str) -> Layer:
    return Layer(name, tuple(patterns))


R, K = RUNTIME, KERNELS

# Top to bottom. Keep docs/architecture.md ("Layers") in step with this table.
LAYERS = (
    _l("tools", f"{R}.demo", f"{R}.demo.*"),
    _l("plugin", f"{R}.plugin"),
    _l("install", f"{R}.install", f"{R}.startup_checks", f"{R}.memory_budget"),
    _l("builder", f"{R}.builder"),
    _l("manager", f"{R}.manager", f"{R}.manager.*"),
    _l("violations", f"{R}.violations", f"{R}.violations.*"),
    _l("single-forward manager", f"{R}.single_forward_manager", f"{R}.single_forward_manager.*"),
    _l(
        "adapters, perturb, oracle, token history",
        f"{R}.pool_patcher",
        f"{R}.pool_patcher.*",
        f"{R}.perturb",
        f"{R}.perturb.perturber",
        f"{R}.perturb.real_kv",
        f"{R}.perturb.report",
        f"{R}.token_oracle",
        f"{R}.token_oracle.expected_tokens",
        f"{R}.token_oracle.spec_verify",
        f"{R}.token_oracle.sampler",
        f"{R}.token_history",
        f"{R}.endpoint",
    ),
    _l(
        "config",
        f"{R}.config",
        f"{R}.server_args_ext",
        f"{R}.envs",
        f"{R}.perturb.config",
        f"{R}.token_oracle.oracle",
    ),
    _l(
        "leaves",
        R,
        f"{R}.state",
        f"{R}.buffer_group",
        f"{R}.capacities",
        f"{R}.memory",
        f"{R}.ranks",
        f"{R}.plan_input",
        f"{R}.expected_inputs",
        f"{R}.batch_state",
        f"{R}.radix_cache_walker",
        f"{R}.cuda_streams",
        f"{R}.sweep_plan_builder",
        f"{R}.snapshot_buffers",
    ),
    _l("sglang seam", f"{R}.sglang_seam", f"{R}.sglang_seam.*"),
    _l("kernel package", K),
    _l(
        "kernel launchers",
        f"{K}.verify",
        f"{K}.write",
        f"{K}.plan",
        f"{K}.plan.api",
        f"{K}.scatter_req_token_ids",
        f"{K}.tree_parents",
        f"{K}.stage_inputs",
        f"{K}.deep",
        f"{K}.rows",
    ),
    _l(
        "kernel bodies and references",
        f"{K}.verify_ref",
        f"{K}.write_ref",
        f"{K}.plan_ref",
        f"{K}.deep_ref",
        f"{K}._hash_triton",
        f"{K}._ring_triton",
        f"{K}._chain_triton",
        f"{K}._tree_triton",
        f"{K}._kernel_consts",
        f"{K}.plan.offsets_kernel",
        f"{K}.plan.entries_kernel",
        f"{K}.plan.utils",
    ),
    _l("kernel validation", f"{K}.validation"),
    _l(
        "kernel types",
        f"{K}.types",
        f"{K}.types.tags",
        f"{K}.types.context",
        f"{K}.types.plans",
        f"{K}.types.deep",
    ),
    _l(
        "kernel leaves",
        f"{K}.consts",
        f"{K}._checks",
        f"{K}._launch",
        f"{K}._hash_torch",
        f"{K}._ring_torch",
    ),
)

# modules allowed to import sglang beyond the two kv_canary packages
SGLANG_IMPORTERS = (f"{R}.sglang_seam", f"{R}.sglang_seam.*", f"{R}.demo.*")
KERNEL_FILES = (f"{K}.verify", f"{K}.write")


def sglang_import_violations(graph: ImportGraph, allowed=SGLANG_IMPORTERS) -> list:
    layer = Layer("allowed", tuple(allowed))
    return [
        f"{e.source}:{e.line} imports {e.target}"
        for e in graph.all_edges()
        if not e.internal
        and (e.target == "sglang" or e.target.startswith("sglang."))
        and not layer.matches(e.source)
    ]


def kernel_file_violations(graph: ImportGraph) -> list:
    """Runtime imports from verify.py / write.py of anything but ``launch_*``."""
    return [
        f"{e.source}:{e.line} imports {', '.join(e.names) or 'the module'} from {e.target}"
        for e in graph.internal_edges()
        if e.source.startswith(RUNTIME + ".")
        and e.target in KERNEL_FILES
        and not (e.names and all(n.startswith("launch_") for n in e.names))
    ]


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph(SOURCE_ROOT, PACKAGES)


def test_every_module_has_one_layer(graph):
    assert len(graph.modules) > 40  # the tree was found
    _, problems = assign_layers(graph, LAYERS)
    assert problems == []


def test_no_import_goes_up(graph):
    assert layer_violations(graph, LAYERS) == []


def test_no_import_cycle(graph):
    assert graph.cycles() == []


def test_only_the_seam_imports_sglang(graph):
    assert sglang_import_violations(graph) == []
    # the seam does import sglang (the check is not vacuous)
    assert any(e.source.startswith(f"{R}.sglang_seam.") and not e.internal for e in graph.edges)


def test_runtime_takes_only_launchers_from_the_kernel_files(graph):
    assert kernel_file_violations(graph) == []
    assert any(
        e.target in KERNEL_FILES and e.source.startswith(RUNTIME) for e in graph.internal_edges()
    )


# ---- the checks catch what they should (a planted tree) ----------------------------------------


def _tree(tmp_path: pathlib.Path, files: dict) -> ImportGraph:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return ImportGraph(tmp_path, ("pkg",))


PLANTED_LAYERS = (
    Layer("top", ("pkg.top",)),
    Layer("mid", ("pkg.mid", "pkg.mid.*")),
    Layer("low", ("pkg.low",)),
)


def test_planted_upward_import_cycle_and_typing_import(tmp_path):
    g = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/top.py": "from pkg import mid\n",
            "pkg/mid/__init__.py": "from .a import x\n",
            "pkg/mid/a.py": "x = 1\nfrom typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pkg import top\n",
            "pkg/low.py": "def f():\n    from pkg.mid.a import x  # lazy, still counts\n"
            "    import sglang.srt.server_args\n",
        },
    )
    problems = layer_violations(g, PLANTED_LAYERS)
    assert any("pkg.low" in p and "imports pkg.mid.a" in p for p in problems)
    assert any("pkg matches 0 layers" in p for p in problems)  # the package itself: unassigned
    # the TYPE_CHECKING import of a higher layer goes up too, and closes a circle
    assert any("pkg.mid.a" in p and "imports pkg.top" in p for p in problems), problems
    assert g.cycles() == [["pkg.mid", "pkg.mid.a", "pkg.top"]]
    # a two-file cycle through a relative import
    (tmp_path / "pkg/mid/a.py").write_text("from ..low import f\n")
    (tmp_path / "pkg/low.py").write_text("from pkg.mid import a\n")
    assert ImportGraph(tmp_path, ("pkg",)).cycles() == [["pkg.low", "pkg.mid.a"]]


def test_planted_sglang_import_and_kernel_type_import(tmp_path):
    g = _tree(
        tmp_path,
        {
            "sglang/srt/kv_canary/__init__.py": "",
            "sglang/srt/kv_canary/leaf.py": "from sglang.srt.model_executor.forward_batch_info import ForwardMode\n"
            "from sglang.jit_kernel.kv_canary.verify import VerifyPlan, launch_canary_verify_kernel\n"
            "from sglang.jit_kernel.kv_canary.write import launch_canary_write_kernel\n",
            "sglang/srt/kv_canary/sglang_seam.py": "import sglang.srt.layers.sampler\n",
            "sglang/jit_kernel/kv_canary/__init__.py": "",
            "sglang/jit_kernel/kv_canary/verify.py": "",
            "sglang/jit_kernel/kv_canary/write.py": "",
        },
    )
    g = ImportGraph(tmp_path, PACKAGES)
    assert sglang_import_violations(g) == [
        "sglang.srt.kv_canary.leaf:1 imports sglang.srt.model_executor.forward_batch_info"
    ]
    assert kernel_file_violations(g) == [
        "sglang.srt.kv_canary.leaf:2 imports VerifyPlan from sglang.jit_kernel.kv_canary.verify"
    ]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
