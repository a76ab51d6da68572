"""End-to-end workload script:
``python workload.py MODEL_DIR MODE [engine kwargs as JSON] [cpu|cuda]``.

Runs a clean workload on an Engine (CPU by default): 48 requests over three shared long prefixes (radix
hits), mixed lengths, in four batches; prints ``INFO <json>`` (the server info's ``kv_canary``
and ``max_total_num_tokens``) and ``RESULT <json>`` with the greedy outputs.
"""

import json
import random
import sys

from sglang.srt.kv_canary.testing.server_harness import cpu_engine_kwargs, gpu_engine_kwargs


def requests():
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 500) for _ in range(n)] for n in (120, 90, 60)]
    reqs = []
    for i in range(48):
        p = prefixes[i % 3]
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
        reqs.append((p[: rng.randint(len(p) // 2, len(p))] + tail, rng.randint(1, 24)))
    return reqs


if __name__ == "__main__":
    import sglang

    model_dir, mode = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    make_kwargs = gpu_engine_kwargs if device == "cuda" else cpu_engine_kwargs
    engine = sglang.Engine(**make_kwargs(model_dir, kv_canary=mode, **extra))
    outputs = []
    reqs = requests()
    for b in range(0, len(reqs), 12):
        batch = reqs[b:b + 12]
        outs = engine.generate(
            input_ids=[r[0] for r in batch],
            sampling_params=[{"max_new_tokens": r[1], "temperature": 0, "ignore_eos": True}
                             for r in batch])
        outputs += [o["output_ids"] for o in outs]
    info = engine.get_server_info()
    print("INFO " + json.dumps({k: info.get(k) for k in ("kv_canary", "max_total_num_tokens")}),
          flush=True)
    print("RESULT " + json.dumps(outputs), flush=True)
    engine.shutdown()
