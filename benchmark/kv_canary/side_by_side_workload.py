"""The child process of ``detect_side_by_side.py``: one ``sglang.Engine`` and one workload, for
either stack (sglang 0.5.12 with this project's canary, or upstream sglang with its own).

``python side_by_side_workload.py ENGINE_KWARGS_JSON REQUESTS_JSON_FILE``

It imports nothing of this project (under upstream's ``PYTHONPATH`` this project's modules are
out of reach): it prints ``SIDE_BY_SIDE_INFO {"version": ...}`` once sglang is imported, runs
the requests (``[[input_ids, max_new_tokens], ...]``) in waves of 12 with greedy sampling, and
prints ``SIDE_BY_SIDE_RESULT {"requests": n, "generated_tokens": m, "failed_waves": [...]}``
once every wave was sent. A wave whose call raises (abort mode fails an aborted request's
non-streaming call with its message: sglang's HTTP 500) is listed with its error and the next
wave is sent: whether the server keeps serving is what is measured. An error outside the
waves (a refused flag at start-up) propagates: the exit status is non-zero and the traceback
is on stderr; a canary in ``raise`` mode stopping the server ends the process.
"""

import json
import sys

INFO_PREFIX = "SIDE_BY_SIDE_INFO "
RESULT_PREFIX = "SIDE_BY_SIDE_RESULT "
WAVE = 12


def main() -> None:
    import sglang

    print(INFO_PREFIX + json.dumps({"version": getattr(sglang, "__version__", None)}), flush=True)
    kwargs = json.loads(sys.argv[1])
    with open(sys.argv[2]) as f:
        requests = json.load(f)
    engine = sglang.Engine(**kwargs)
    generated, failed = 0, []
    try:
        for b in range(0, len(requests), WAVE):
            wave = requests[b : b + WAVE]
            try:
                outs = engine.generate(
                    input_ids=[r[0] for r in wave],
                    sampling_params=[
                        {"max_new_tokens": r[1], "temperature": 0, "ignore_eos": True} for r in wave
                    ],
                )
            except Exception as e:  # noqa: BLE001 - recorded: the next wave still goes
                failed.append({"wave": b // WAVE, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            generated += sum(len(o["output_ids"]) for o in outs)
    finally:
        engine.shutdown()
    print(
        RESULT_PREFIX
        + json.dumps(
            {"requests": len(requests), "generated_tokens": generated, "failed_waves": failed}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
