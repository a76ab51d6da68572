"""``python oracle_workload.py MODEL_DIR``: a CPU Engine with ``--kv-canary raise`` and
``sampling_backend="token_oracle"`` (which sglang's CPU engine rewrites to ``pytorch``: the
canary must still sample with the oracle). Prints ``RESULT <json>``: per request its id, prompt
length and output ids."""

import json
import sys

from sglang.srt.kv_canary.testing.server_harness import cpu_engine_kwargs

if __name__ == "__main__":
    import sglang

    engine = sglang.Engine(**cpu_engine_kwargs(sys.argv[1], kv_canary="raise",
                                               sampling_backend="token_oracle",
                                               log_level="info"))
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13], [5, 6, 7, 8, 9] * 3 + [40]]
    outs = engine.generate(input_ids=prompts,
                           sampling_params=[{"max_new_tokens": 12, "temperature": 0,
                                             "ignore_eos": True}] * len(prompts))
    print("RESULT " + json.dumps([
        {"rid": o["meta_info"]["id"], "prompt_len": len(p), "output_ids": o["output_ids"]}
        for p, o in zip(prompts, outs)]), flush=True)
    engine.shutdown()
