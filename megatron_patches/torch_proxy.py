"""A per-module stand-in for the ``torch`` module global, used by CPU shims.

Several megatron-core modules call tensor factories with a hard-coded ``device="cuda"``
(``torch.zeros(1, device="cuda")``). Rather than copying those function bodies, a shim swaps the
*module's own* ``torch`` global for a proxy: factory calls on a CUDA device are sent to the CPU,
and every other attribute is read from the real ``torch``. Nothing outside the patched module
sees the proxy, so the rest of the process keeps the real ``torch``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from megatron_patches import compat

# torch tensor factories that take a ``device=`` keyword
FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "randn",
    "rand",
)


def is_cuda_device(device: Any) -> bool:
    """True for "cuda", "cuda:N", torch.device("cuda", N) and bare ints (CUDA ordinals)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    # an int device is a CUDA ordinal in megatron's code (torch.cuda.current_device());
    # bool is an int subclass but never a device
    return isinstance(device, int) and not isinstance(device, bool)


def cpu_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a torch factory so that ``device=<cuda>`` becomes ``device="cpu"``."""

    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
            # pinned memory needs an accelerator; it has no meaning for a CPU-resident tensor
            kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


class TorchProxy(types.ModuleType):
    """Reads through to ``base`` (the real torch, or an inner proxy) except for overrides."""

    def __init__(
        self,
        base: types.ModuleType,
        patch_name: str,
        overrides: dict[str, Any],
        name: str = "torch",
    ):
        super().__init__(name)
        self._moe_rl_base = base
        self.__dict__.update(overrides)
        compat.mark(self, patch_name)

    def __getattr__(self, name: str) -> Any:
        # only called for names not set on the proxy itself
        return getattr(self._moe_rl_base, name)


def find(module: types.ModuleType, patch_name: str) -> TorchProxy | None:
    """The proxy that ``patch_name`` installed as ``module.torch``, if any (walks nesting)."""
    current = module.__dict__.get("torch")
    while isinstance(current, TorchProxy):
        if current.__dict__.get(compat.MARKER) == patch_name:
            return current
        current = current._moe_rl_base
    return None


def check_module_uses_torch(module: types.ModuleType) -> None:
    """Precondition: ``module`` reads tensor factories through a global named ``torch``."""
    current = compat.check_attr(module, "torch")
    while isinstance(current, TorchProxy):
        current = current._moe_rl_base
    if current is not torch:
        raise compat.PatchError(
            f"{module.__name__}.torch is {current!r}, not the torch module; the shim would miss it"
        )


def install(module: types.ModuleType, patch_name: str, extra: dict[str, Any] | None = None) -> None:
    """Replace ``module.torch`` with a proxy whose factories map CUDA devices to the CPU.

    Args:
        module: the megatron module whose global ``torch`` is replaced.
        patch_name: recorded on the proxy, for idempotency and ``find``.
        extra: further attribute overrides (e.g. a CPU stand-in for ``torch.cuda``).
    """
    if find(module, patch_name) is not None:
        return
    base = module.torch
    overrides: dict[str, Any] = {name: cpu_factory(getattr(base, name)) for name in FACTORIES}
    overrides.update(extra or {})
    module.torch = TorchProxy(base, patch_name, overrides)
