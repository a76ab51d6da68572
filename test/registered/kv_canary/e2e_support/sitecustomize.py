"""Test hook loaded into every process of an end-to-end server (via PYTHONPATH).

With ``KV_CANARY_TEST_CORRUPT_AFTER=N`` it registers, before sglang loads its plugins, an
AFTER hook on ``ModelRunner.forward`` that, after the N-th forward with the canary on, bumps
the position field of every HEAD K record: the next forward's HEAD verify must report it.
"""

import os

_n = os.environ.get("KV_CANARY_TEST_CORRUPT_AFTER")
if _n:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _calls = {"n": 0}

    def _corrupt(result, self, *args, **kwargs):
        manager = getattr(self, "kv_canary_manager", None)
        if manager is None:
            return result
        _calls["n"] += 1
        if _calls["n"] == int(_n):
            import torch

            for group in manager.groups:
                group.k_head.view(torch.int64)[1:, 1] += 1000
            print(f"KV_CANARY_TEST: corrupted HEAD K records after forward {_calls['n']}",
                  flush=True)
        return result

    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.forward",
                          _corrupt, HookType.AFTER)
