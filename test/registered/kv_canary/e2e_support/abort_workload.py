"""Abort-mode workload on an Engine:
``python abort_workload.py MODEL_DIR [engine kwargs as JSON] [cpu|cuda] [waves|short|long]``.

``waves`` (the default): ``WAVES`` waves of 6 concurrent requests sharing a prefix
(``Engine.async_generate``, each with its own ``rid``), then one more wave; ``short``: the
first ``SHORT_WAVES`` of them, then the same last wave (faults with a warm-up of a few steps
land in the first wave). ``long``: one
request of ``LONG_PROMPT`` tokens alone (many chunks of a small ``chunked_prefill_size``),
then the same last wave. Prints ``RESULT <json>``: per rid, ``"ok"`` with the number of output
tokens, or the error the request ended with; ``later``: the last wave's; ``server_info``: the
``kv_canary`` entry of ``Engine.get_server_info()``.
"""

import asyncio
import sys

from engine_main import main

MAX_NEW = 16
WAVES = 6
SHORT_WAVES = 2
LONG_PROMPT = 160


async def one(engine, rid, ids):
    try:
        out = await engine.async_generate(
            input_ids=ids,
            rid=rid,
            sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        )
    except Exception as e:  # the abort reaches the caller as an error
        return {"error": f"{type(e).__name__}: {e}"}
    reason = out["meta_info"]["finish_reason"]
    if reason.get("type") == "abort":
        return {"error": f"finish_reason abort: {reason.get('message')}"}
    return {"ok": len(out["output_ids"])}


async def wave(engine, tag, prefix_len):
    prefix = list(range(10, 10 + prefix_len))
    jobs = {f"{tag}-{i}": prefix + [200 + i, 300 + i] for i in range(6)}
    got = await asyncio.gather(*(one(engine, rid, ids) for rid, ids in jobs.items()))
    return dict(zip(jobs, got))


MODES = ("waves", "short", "long")


def run(engine, args):
    mode = args.rest[0] if args.rest else "waves"
    if mode not in MODES:
        sys.exit(f"abort_workload.py: mode {mode!r}; allowed: {', '.join(MODES)}")
    loop = asyncio.get_event_loop()
    results = {}
    if mode == "long":
        ids = [(7 * k) % 500 + 3 for k in range(LONG_PROMPT)]
        results["long"] = loop.run_until_complete(one(engine, "long", ids))
    else:
        waves = SHORT_WAVES if mode == "short" else WAVES
        for w in range(waves):  # ~20 forward steps each: past any warm-up of a few dozen
            results.update(loop.run_until_complete(wave(engine, f"w{w}", 32 + 4 * w)))
    later = loop.run_until_complete(wave(engine, "later", 36))
    info = engine.get_server_info().get("kv_canary")
    return {"results": results, "later": later, "server_info": info}


if __name__ == "__main__":
    main(run, fixed_kwargs=dict(kv_canary="abort"))
