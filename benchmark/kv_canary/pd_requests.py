"""The requests of ``pd_one_gpu.py`` (docs/user_guide.md, "Deployments"): its prompts
(pairwise different first tokens) and each one's control with every token but the last
replaced, one ``/generate`` with its body, and one request the way a PD router sends it (the
same body, bootstrap fields included, to the prefill and the decode server at once)."""

from __future__ import annotations

import json
import random
import threading


# ---- prompts ------------------------------------------------------------------------------------


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids in [3, vocab), pairwise different first tokens."""
    rng = random.Random(seed)
    firsts = rng.sample(range(3, vocab), n)
    return [[f] + [rng.randrange(3, vocab) for _ in range(length - 1)] for f in firsts]


def perturbed(prompt: list[int], vocab: int, rng: random.Random, taken: set) -> list[int]:
    """``prompt`` with every token but the last replaced (first token unused so far)."""
    first = rng.choice([t for t in range(3, vocab) if t not in taken])
    taken.add(first)
    return [first] + [rng.randrange(3, vocab) for _ in range(len(prompt) - 2)] + [prompt[-1]]


# ---- HTTP ---------------------------------------------------------------------------------------


def generate(http_call, port: int, body: dict, timeout: float) -> dict:
    """POST /generate; the JSON answer, or ``{"error": ...}``."""
    try:
        status, raw = http_call(port, "POST", "/generate", body, timeout=timeout)
    except Exception as e:  # noqa: BLE001  (reported, the run goes on)
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        out = json.loads(raw)
    except ValueError:
        return {"error": f"HTTP {status}: {raw[:300]!r}"}
    if status != 200:
        return {"error": f"HTTP {status}: {json.dumps(out)[:300]}"}
    return out if isinstance(out, dict) else {"error": f"unexpected answer {str(out)[:300]}"}


def body_for(prompt: list[int], max_new: int, boot: dict | None = None) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True},
    }
    if boot:
        body.update(boot)
    return body


def pd_request(
    http_call,
    prefill_port: int,
    decode_port: int,
    bootstrap_port: int,
    prompt: list[int],
    max_new: int,
    timeout: float,
) -> dict:
    """One request the way a PD router sends it: the same body, bootstrap fields included, to
    the prefill and the decode server at once; the decode server's answer plus the prefill's
    status."""
    boot = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.SystemRandom().randrange(1, 2**63 - 1),
    }
    body = body_for(prompt, max_new, boot)
    answers: dict[str, dict] = {}

    def send(name: str, port: int) -> None:
        answers[name] = generate(http_call, port, body, timeout)

    threads = [
        threading.Thread(target=send, args=(n, p), daemon=True)
        for n, p in (("prefill", prefill_port), ("decode", decode_port))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    dec = answers.get("decode", {"error": "no answer (thread still running)"})
    pre = answers.get("prefill", {"error": "no answer (thread still running)"})
    out = {"room": boot["bootstrap_room"], "output_ids": dec.get("output_ids")}
    if "error" in dec:
        out["error"] = "decode: " + dec["error"]
    if "error" in pre:
        out["prefill_error"] = pre["error"]
    return out
