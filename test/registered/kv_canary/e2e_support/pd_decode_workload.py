"""A decode-only PD server with sglang's ``fake`` transfer backend:
``python pd_decode_workload.py MODEL_DIR [engine kwargs as JSON]`` (the CPU engine).

The ``fake`` backend "receives" every request's prefill at once and moves no bytes: neither the
prompt's KV nor the canary rows arrive, so the slots sglang allocates for the prompt hold
whatever was there. Three requests of 30 prompt tokens, one at a time, 6 greedy tokens each,
with sglang's fake bootstrap host (a decode server needs a bootstrap host, port and room per
request). Prints ``RESULT <json>`` with the outputs and each request's id.
"""

from engine_main import main

PROMPT_LEN = 30


def run(engine, args):
    outputs, rids = [], []
    for i in range(3):
        (out,) = engine.generate(
            input_ids=[list(range(10 + i, 10 + i + PROMPT_LEN))],
            sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            bootstrap_host=["2.2.2.2"],
            bootstrap_port=[8998],
            bootstrap_room=[100 + i],
        )
        outputs.append(out["output_ids"])
        rids.append(out["meta_info"]["id"])
    return {"outputs": outputs, "rids": rids}


if __name__ == "__main__":
    main(
        run, fixed_kwargs=dict(disaggregation_mode="decode", disaggregation_transfer_backend="fake")
    )
