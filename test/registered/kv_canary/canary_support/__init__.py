"""Test support of the KV-canary suites and benchmarks (not shipped with the runtime): server
processes, the tiny model shapes beyond the demo's Llama, support scripts run in a child and
their results, and the containment storm. The demo's own needs (the tiny Llama, the libcuda
stub, engine arguments, ports) stay in ``sglang.srt.kv_canary.testing.server_harness``.
Importable from the test directory (pytest puts it on ``sys.path``); the benchmarks put it
there through ``benchmark/kv_canary/common.py``."""
