"""sglang's sampler module: the base class and backend registration the token oracle uses.

| sglang internal (0.5.12) | what the canary does with it | used by |
| --- | --- | --- |
| ``sglang.srt.layers.sampler`` | ``Sampler`` base class (its ``__init__`` is skipped: :func:`init_sampler_module_only`), ``register_sampler_backend``, the private ``_CUSTOM_SAMPLER_FACTORIES`` (idempotent registration) | ``token_oracle.sampler`` |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only
    pass


def sglang_sampler_class() -> type:
    from sglang.srt.layers.sampler import Sampler

    return Sampler


def init_sampler_module_only(sampler) -> None:
    """Initialise a ``Sampler`` subclass as a bare ``nn.Module``: sglang's
    ``Sampler.__init__`` reads the tensor-parallel group and sampling options that a sampler
    ignoring the logits does not use."""
    import torch.nn

    torch.nn.Module.__init__(sampler)


def register_sampler_backend(name: str, factory: Callable) -> None:
    """sglang's ``register_sampler_backend`` (adds ``name`` to ``--sampling-backend``), once
    per process: a second call with the same factory is a no-op (sglang would warn)."""
    from sglang.srt.layers import sampler as sampler_mod

    if sampler_mod._CUSTOM_SAMPLER_FACTORIES.get(name) is factory:
        return
    sampler_mod.register_sampler_backend(name, factory)
