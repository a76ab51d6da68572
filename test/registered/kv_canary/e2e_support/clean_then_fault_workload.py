"""One server run in two phases (the TP 2 CPU test, ``test_e2e_tp_server.py``): ``python
clean_then_fault_workload.py MODEL_DIR [engine kwargs as JSON] [cpu|cuda]``.

Clean phase: ``small_workload.py``'s three waves (12 requests, 8 greedy tokens each), then one
``CLEAN <json>`` line on stderr, the stream every process of the server logs to: the outputs
and the schedulers' ``kv_canary`` internal states. A scheduler logs a forward's lines before
the forward's outputs return, so TP rank 0's lines of every forward of the phase precede it
(another rank's may follow it). Fault phase: :data:`FAULT_ROUNDS` rounds of 4 requests of
:data:`FAULT_TOKENS` greedy tokens, the forwards in which the server's fault injection (its
warm-up set past the clean phase's forwards) starts; a raise-mode report stops the server and
this process during it. ``RESULT <json>`` (the fault phase's outputs) only when it does not.
"""

import json
import sys

from engine_main import CLEAN_TAG, main
from small_workload import waves

FAULT_ROUNDS = 3
FAULT_TOKENS = 64


def run(engine, args):
    greedy = {"temperature": 0, "ignore_eos": True}
    clean = []
    for wave in waves():
        outs = engine.generate(input_ids=wave, sampling_params=dict(greedy, max_new_tokens=8))
        clean += [o["output_ids"] for o in outs]
    info = engine.get_server_info()
    live = [s.get("kv_canary") for s in info.get("internal_states") or []]
    sys.stderr.write(CLEAN_TAG + json.dumps({"outputs": clean, "kv_canary_live": live}) + "\n")
    sys.stderr.flush()
    faulted = []
    for r in range(FAULT_ROUNDS):
        prompts = [list(range(200 + 10 * r, 212 + 10 * r)) + [450 + i] for i in range(4)]
        outs = engine.generate(
            input_ids=prompts, sampling_params=dict(greedy, max_new_tokens=FAULT_TOKENS)
        )
        faulted += [o["output_ids"] for o in outs]
    return faulted


if __name__ == "__main__":
    main(run)
