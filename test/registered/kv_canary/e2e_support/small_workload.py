"""A small end-to-end workload for slow model shapes (e.g. MLA under the Triton interpreter):
``python small_workload.py MODEL_DIR [engine kwargs as JSON] [cpu|cuda]``.

Three waves of 4 requests: each wave shares a prefix of 40-64 tokens with its own tails, and
the third wave repeats the first wave's prefix (a radix hit); 8 greedy tokens each. Prints
``INFO <json>`` (the server info's ``kv_canary`` and ``max_total_num_tokens``) and ``RESULT
<json>`` with the outputs.
"""

from engine_main import emit_server_info, main


def waves():
    prefixes = [list(range(10, 50)), list(range(100, 164)), list(range(10, 50))]
    return [[p + [300 + 7 * w + i, 400 + i] for i in range(4)] for w, p in enumerate(prefixes)]


def run(engine, args):
    outputs = []
    for wave in waves():
        outs = engine.generate(
            input_ids=wave,
            sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
        outputs += [o["output_ids"] for o in outs]
    emit_server_info(engine)
    return outputs


if __name__ == "__main__":
    main(run)
