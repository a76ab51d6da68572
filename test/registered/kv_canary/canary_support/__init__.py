"""Test support of the KV-canary suites and benchmarks (not shipped with the runtime): a
server's Prometheus series and the Mooncake check, the tiny model shapes beyond the demo's
Llama, support scripts run in a child and their results, and the containment storm. The demo's own needs (the tiny Llama, the libcuda
stub, engine arguments, ports, server processes, a PD pair) stay in the runtime package's
``sglang.srt.kv_canary.demo`` (``server_harness``, ``server_process``, ``pd_pair``).
Importable from the test directory (pytest puts it on ``sys.path``); the benchmarks put it
there through ``benchmark/kv_canary/common.py``."""
