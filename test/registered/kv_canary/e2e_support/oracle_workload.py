"""``python oracle_workload.py MODEL_DIR [engine kwargs as JSON] [cpu|cuda]``: an Engine with
``sampling_backend="token_oracle"`` (which sglang's CPU engine rewrites to ``pytorch``: the
canary must still sample with the oracle), ``--kv-canary raise`` and log level ``info`` unless
given. Prints ``RESULT <json>``: per request its id, prompt length and output ids."""

from engine_main import main

PROMPTS = [[5, 6, 7, 8, 9] * 4, [11, 12, 13], [5, 6, 7, 8, 9] * 3 + [40]]


def run(engine, args):
    outs = engine.generate(
        input_ids=PROMPTS,
        sampling_params=[{"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}]
        * len(PROMPTS),
    )
    return [
        {"rid": o["meta_info"]["id"], "prompt_len": len(p), "output_ids": o["output_ids"]}
        for p, o in zip(PROMPTS, outs)
    ]


if __name__ == "__main__":
    main(
        run,
        fixed_kwargs=dict(sampling_backend="token_oracle"),
        default_kwargs=dict(kv_canary="raise", log_level="info"),
    )
