"""End-to-end workload script:
``python workload.py MODEL_DIR [engine kwargs as JSON, ``kv_canary`` among them] [cpu|cuda]``.

Runs a clean workload on an Engine (CPU by default): 48 requests over three shared long
prefixes (radix hits), mixed lengths, in four batches; prints ``INFO <json>`` (the server info's ``kv_canary``
and ``max_total_num_tokens``) and ``RESULT <json>`` with the greedy outputs.
"""

import random

from engine_main import emit_server_info, main


def requests():
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 500) for _ in range(n)] for n in (120, 90, 60)]
    reqs = []
    for i in range(48):
        p = prefixes[i % 3]
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
        reqs.append((p[: rng.randint(len(p) // 2, len(p))] + tail, rng.randint(1, 24)))
    return reqs


def run(engine, args):
    outputs = []
    reqs = requests()
    for b in range(0, len(reqs), 12):
        batch = reqs[b : b + 12]
        outs = engine.generate(
            input_ids=[r[0] for r in batch],
            sampling_params=[
                {"max_new_tokens": r[1], "temperature": 0, "ignore_eos": True} for r in batch
            ],
        )
        outputs += [o["output_ids"] for o in outs]
    emit_server_info(engine)
    return outputs


if __name__ == "__main__":
    main(run)
