"""A small end-to-end workload for slow model shapes (e.g. MLA under the Triton interpreter):
``python small_workload.py MODEL_DIR [engine kwargs as JSON] [cpu|cuda] [two-phase]``.

Three waves of 4 requests: each wave shares a prefix of 40-64 tokens with its own tails, and
the third wave repeats the first wave's prefix (a radix hit); 8 greedy tokens each. Prints
``INFO <json>`` (the server info's ``kv_canary`` and ``max_total_num_tokens``) and ``RESULT
<json>`` with the outputs.

``two-phase``: the waves, a ``KV_CANARY_TEST_PHASE_END clean`` line on stderr
(``engine_main.end_phase``), then the waves twice more, every token one higher, then two
higher (no prefix shared with an earlier round: the same shape of work, on fresh slots);
``RESULT`` is then ``{"clean": [12 outputs], "second": [24 outputs]}`` and ``INFO`` is
printed after both phases.
"""

import sys

from engine_main import emit_server_info, end_phase, main

MODES = ("two-phase",)


def waves(shift=0):
    prefixes = [list(range(10, 50)), list(range(100, 164)), list(range(10, 50))]
    return [
        [[t + shift for t in p + [300 + 7 * w + i, 400 + i]] for i in range(4)]
        for w, p in enumerate(prefixes)
    ]


def generate(engine, shift=0):
    outputs = []
    for wave in waves(shift):
        outs = engine.generate(
            input_ids=wave,
            sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
        outputs += [o["output_ids"] for o in outs]
    return outputs


def run(engine, args):
    if args.rest and args.rest != MODES:
        sys.exit(f"small_workload.py: arguments {list(args.rest)}; allowed: none, or {MODES[0]}")
    if not args.rest:
        outputs = generate(engine)
    else:
        clean = generate(engine)
        end_phase("clean")
        outputs = {"clean": clean, "second": generate(engine, 1) + generate(engine, 2)}
    emit_server_info(engine)
    return outputs


if __name__ == "__main__":
    main(run)
