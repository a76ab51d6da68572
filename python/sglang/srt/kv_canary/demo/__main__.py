"""``python -m sglang.srt.kv_canary.demo``: runs :func:`~sglang.srt.kv_canary.demo.cli.main`
(docs/user_guide.md, "Self-tests: fault injection, the token oracle, the demo")."""

import sys

from sglang.srt.kv_canary.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())
