"""A workload whose reused prefixes do not fit the device pool, for HiCache:
``python hicache_workload.py MODEL_DIR [engine kwargs as JSON] [cpu|cuda] [two-phase]``.

Eight prompts of 91 tokens (90 distinct each, then one more), one at a time, 4 greedy tokens
each; then the eight again: with a 256-token device pool, the first round's prefixes are
backed up to the host pool and evicted from the device, and the second round loads them back.
Prints ``RESULT <json>`` with the outputs and the cached tokens of each request.

``two-phase``: those two rounds, a ``KV_CANARY_TEST_PHASE_END clean`` line on stderr
(``engine_main.end_phase``), then the two rounds again (each prefix loaded back from the host
in each round); ``RESULT`` is then ``{"clean": {...}, "second": {...}}``, one of the above
for each phase.
"""

import sys

from engine_main import end_phase, main

PROMPTS = [[(7 * p + i) % 500 + 3 for i in range(90)] + [400 + p] for p in range(8)]
MODES = ("two-phase",)


def rounds(engine):
    outputs, cached = [], []
    for _ in range(2):
        for prompt in PROMPTS:
            out = engine.generate(
                input_ids=prompt,
                sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            )
            outputs.append(out["output_ids"])
            cached.append(out["meta_info"].get("cached_tokens", 0))
    return {"outputs": outputs, "cached": cached}


def run(engine, args):
    if args.rest and args.rest != MODES:
        sys.exit(f"hicache_workload.py: arguments {list(args.rest)}; allowed: none, or {MODES[0]}")
    if not args.rest:
        return rounds(engine)
    clean = rounds(engine)
    end_phase("clean")
    return {"clean": clean, "second": rounds(engine)}


if __name__ == "__main__":
    main(run)
