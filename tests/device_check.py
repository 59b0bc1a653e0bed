"""A mode in which a tensor that moe-rl creates without saying where cannot meet the model's.

Inside ``strict_device()``, every tensor factory (``torch.arange``, ``zeros``, ``tensor``, ...)
called from moe-rl's own code without an explicit ``device`` makes its tensor on the ``meta``
device. The model and data stay on the CPU, so such a tensor fails loudly the moment it meets
them (or is read), naming the line: exactly what a forgotten device does on a GPU, where the
default device (the CPU) is not the model's. Factories called by torch or megatron-core
themselves are left alone; tensors derived from others (``x.new_zeros``, ``zeros_like``) carry
their source's device and pass.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

PACKAGE = str(Path(__file__).resolve().parents[1] / "moe_rl")
TORCH = str(Path(torch.__file__).resolve().parent)
FACTORIES = {
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.tensor,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.as_tensor,
    torch.scalar_tensor,
}


def _package_caller() -> str | None:
    """``file:line`` of the innermost frame outside torch and this module, if it is moe-rl's."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(TORCH)
    ):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(PACKAGE):
        return None
    return f"{frame.f_code.co_filename[len(PACKAGE) - len('moe_rl') :]}:{frame.f_lineno}"


class _StrictDevice(TorchFunctionMode):
    def __init__(self, redirect: bool) -> None:
        super().__init__()
        self.redirect = redirect
        self.sites: set[str] = set()  # where a factory was called without a device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in FACTORIES and kwargs.get("device") is None:
            data = args[0] if args else kwargs.get("data")
            site = None if func is torch.as_tensor and isinstance(data, torch.Tensor) else _package_caller()
            if site is not None:  # (as_tensor of a tensor keeps its device)
                self.sites.add(site)
                if self.redirect:
                    kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def strict_device(redirect: bool = True):
    """``redirect=False`` only lists the sites (``mode.sites``), leaving their tensors where they were."""
    mode = _StrictDevice(redirect)
    with mode:
        yield mode
