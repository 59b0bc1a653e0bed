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
FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.rand,
             torch.randn, torch.randint, torch.randperm, torch.linspace, torch.logspace, torch.eye,
             torch.as_tensor, torch.scalar_tensor}


def _caller_in_package() -> bool:
    """Whether the innermost frame outside torch and this module is moe-rl's."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith(TORCH)):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(PACKAGE)


class _StrictDevice(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.caught = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in FACTORIES and kwargs.get("device") is None and _caller_in_package():
            data = args[0] if args else kwargs.get("data")
            if not (func is torch.as_tensor and isinstance(data, torch.Tensor)):  # keeps its device
                kwargs["device"] = "meta"
                self.caught += 1
        return func(*args, **kwargs)


@contextmanager
def strict_device():
    mode = _StrictDevice()
    with mode:
        yield mode
