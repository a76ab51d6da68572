"""A small end-to-end workload for slow model shapes (e.g. MLA under the Triton interpreter):
``python small_workload.py MODEL_DIR [engine kwargs as JSON] [cpu|cuda]``.

Three waves of 4 requests: each wave shares a prefix of 40-64 tokens with its own tails, and
the third wave repeats the first wave's prefix (a radix hit); 8 greedy tokens each. Prints
``INFO <json>`` (the server info's ``kv_canary`` and ``max_total_num_tokens``) and ``RESULT
<json>`` with the outputs.
"""

import json
import sys

from sglang.srt.kv_canary.testing.server_harness import cpu_engine_kwargs, gpu_engine_kwargs


def waves():
    prefixes = [list(range(10, 50)), list(range(100, 164)), list(range(10, 50))]
    return [[p + [300 + 7 * w + i, 400 + i] for i in range(4)] for w, p in enumerate(prefixes)]


if __name__ == "__main__":
    import sglang

    model_dir = sys.argv[1]
    extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    make_kwargs = gpu_engine_kwargs if device == "cuda" else cpu_engine_kwargs
    engine = sglang.Engine(**make_kwargs(model_dir, **extra))
    outputs = []
    for wave in waves():
        outs = engine.generate(input_ids=wave, sampling_params={
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        outputs += [o["output_ids"] for o in outs]
    info = engine.get_server_info()
    print("INFO " + json.dumps({k: info.get(k) for k in ("kv_canary", "max_total_num_tokens")}),
          flush=True)
    print("RESULT " + json.dumps(outputs), flush=True)
    engine.shutdown()
