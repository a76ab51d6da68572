"""Isolation for a process that runs upstream's sglang (0.5.17, installed in its own site
directory by ``benchmark/kv_canary/upstream_bundle.sh``) on a machine where this project is
installed editable. Put this folder first on that process's ``PYTHONPATH``, before the
upstream site directory; the processes sglang spawns inherit it and run it too.

- This project's editable finder (``__editable___sglang_kv_canary_*_finder``, on
  ``sys.meta_path`` and ``sys.path_hooks``) answers for any module under
  ``sglang.srt.kv_canary`` / ``sglang.jit_kernel.kv_canary`` that upstream's packages of those
  names lack (``sglang.srt.kv_canary.plugin``, say): this project's modules would be loaded
  into upstream's packages. It is removed.
- sglang's plugin loader would find this project's entry point (``kv_canary`` in
  ``sglang.srt.plugins``): ``SGLANG_PLUGINS``, sglang's allow-list, is set to leave it out
  (unset: to ``none``, which no plugin is named).

Then the next ``sitecustomize`` on ``sys.path``, if any, runs as it would have.
"""

import importlib.machinery
import importlib.util
import os
import sys

_FINDER_MODULE_PREFIX = "__editable___sglang_kv_canary"
_PLUGIN_NAME = "kv_canary"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _ours(obj) -> bool:
    owner = getattr(obj, "__self__", obj)  # a bound path hook: its class
    return getattr(owner, "__module__", "").startswith(_FINDER_MODULE_PREFIX)


def _isolate() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not _ours(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not _ours(h)]
    sys.path[:] = [
        p
        for p in sys.path
        if not (isinstance(p, str) and p.startswith("__editable__.sglang_kv_canary"))
    ]
    sys.path_importer_cache.clear()
    allowed = [x.strip() for x in os.environ.get("SGLANG_PLUGINS", "").split(",") if x.strip()]
    kept = [x for x in allowed if x != _PLUGIN_NAME]
    os.environ["SGLANG_PLUGINS"] = ",".join(kept) if kept else "none"


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows (the next one on ``sys.path``)."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_isolate()
_chain()
