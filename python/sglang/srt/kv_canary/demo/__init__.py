"""The demo, ``python -m sglang.srt.kv_canary.demo`` (:mod:`.cli`: the command line and the
per-run worker; :mod:`.cases`: the cases, the workload and how a run's output is judged), and
what it needs to run a real sglang server with a tiny dummy-weight Llama on the CPU or a GPU
(:mod:`.server_harness`, :mod:`.server_process`, :mod:`.pd_pair`), which the tests and
benchmarks use too. Not used by the runtime. Design: docs/testing.md, "CPU server"."""
