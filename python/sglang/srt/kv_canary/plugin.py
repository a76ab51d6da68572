"""sglang plugin entry point (group ``sglang.srt.plugins``, name ``kv_canary``).

sglang calls :func:`register` in every process through ``load_plugins()``. The hooks it will
register are listed in SPEC §14; until the wiring lands it registers nothing, so installing this
package changes no behaviour of sglang.
"""


def register() -> None:
    """Register the KV-canary hooks with ``HookRegistry`` (none yet: a harmless no-op)."""
    return None
