"""A workload whose requests are retracted and resumed (upstream PR 28254's shape):
``python retract_workload.py MODEL_DIR [engine kwargs as JSON] [cpu|cuda]``.

Run it with ``SGLANG_TEST_RETRACT=1`` (sglang retracts a running request every
``SGLANG_TEST_RETRACT_INTERVAL`` forwards), small prefill chunks and the radix cache off: 6
requests of 40 distinct prompt tokens, 160 output tokens each at temperature 1, sent together.
A request retracted after some output re-prefills its prompt and its output from scratch, and
a non-final chunk of that re-prefill can end inside its output. Prints ``RESULT <json>`` with the output lengths.
"""

from engine_main import main

PROMPT_LEN = 40
MAX_NEW_TOKENS = 160


def prompts():
    return [[(11 * r + 3 * i) % 480 + 20 for i in range(PROMPT_LEN)] for r in range(6)]


def run(engine, args):
    outs = engine.generate(
        input_ids=prompts(),
        sampling_params={"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "ignore_eos": True},
    )
    return [len(o["output_ids"]) for o in outs]


if __name__ == "__main__":
    main(run)
