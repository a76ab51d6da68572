"""A storm of self-test faults on a real HTTP server with many clients, for containment
(docs/user_guide.md, "Containment: --kv-canary abort"); what it runs and checks:
:mod:`canary_support.storm` (the test suites' support package).

    python benchmark/kv_canary/abort_storm.py --mode abort --seconds 600 --out /tmp/storm
    python benchmark/kv_canary/abort_storm.py --mode log --seconds 600 --out /tmp/storm_log
    python benchmark/kv_canary/abort_storm.py --mode heal --stream --seconds 600 --out /tmp/storm_heal
    python benchmark/kv_canary/abort_storm.py --mode abort --device cuda --page-size 16

Prints ``RESULT <json>`` (the figures), then one line per check; exit status 1 when a check
fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import use_test_support  # noqa: E402  (a sibling module)

use_test_support()
from canary_support.storm import StormSettings, run_storm  # noqa: E402


def parse_args(argv=None) -> StormSettings:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("abort", "heal", "log"), required=True)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=48, help="distinct requests in the list")
    ap.add_argument("--pool", type=int, default=1024, help="--max-total-tokens")
    ap.add_argument("--chunk", type=int, default=32, help="--chunked-prefill-size")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--idle-seconds", type=float, default=15)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--stream", action="store_true", help="every other request streams (heal checks chunks)"
    )
    ap.add_argument("--stuck", action="store_true", help="a stuck bit alone (heal retires it)")
    ap.add_argument(
        "--deferred-readback",
        action="store_true",
        help="CPU: read each forward's checks back one forward later, as on CUDA",
    )
    ap.add_argument("--out", type=pathlib.Path, default=None, help="server logs (default: tmp)")
    args = ap.parse_args(argv)
    try:
        return StormSettings(**vars(args))
    except ValueError as e:
        ap.error(str(e))


def main(argv=None) -> int:
    figures = run_storm(parse_args(argv))
    checks = figures["checks"]
    print("RESULT " + json.dumps(figures), flush=True)
    for name, ok in checks.items():
        print(f"abort_storm: {'ok  ' if ok else 'FAIL'} {name}")
    print(f"abort_storm: logs and results.json (rid -> outcome) in {figures['root']}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
