"""No-op CUDA streams, events and synchronize for CPU-only torch builds.

Target: torch.cuda.{Stream, Event, current_stream, default_stream, stream, synchronize}, as
    used by megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.__init__
    (a class-level D2H side stream) and by dist_checkpointing.strategies.filesystem_async and
    DDP (unconditional ``torch.cuda.synchronize()``).
Why: building an MoELayer with the alltoall dispatcher raises
    ``RuntimeError: torch.cuda.Stream requires CUDA support``, and saving a dist checkpoint hits
    ``AssertionError: Torch not compiled with CUDA enabled`` in ``torch.cuda.synchronize()``.
    On a CPU build every op is synchronous, so a stream that does nothing is exact.
Remove when: megatron-core guards its stream/synchronize calls with ``torch.cuda.is_available()``
    (still unguarded in 0.19.2). CPU-only: applying it on a CUDA build raises PatchError.

The stubs are installed on ``torch.cuda`` itself (not per module) because the call sites span
megatron and torch.distributed checkpoint helpers; on a CPU-only build the originals can only
raise, so no working behaviour is replaced.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from megatron_patches import compat

logger = logging.getLogger(__name__)

NAME = "cuda_stream"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = True
STUBBED = ("Stream", "Event", "current_stream", "default_stream", "stream", "synchronize")


class CpuEvent:
    """Stands in for torch.cuda.Event: CPU work is complete when the call returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: CpuEvent) -> float:
        return 0.0


class CpuStream:
    """Stands in for torch.cuda.Stream; all instances compare equal (there is one CPU queue)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0


_THE_STREAM = CpuStream()


def _current_stream(*args: Any, **kwargs: Any) -> CpuStream:
    return _THE_STREAM


@contextlib.contextmanager
def _stream(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


def _synchronize(*args: Any, **kwargs: Any) -> None:
    return None


_STUBS: dict[str, Any] = {
    "Stream": CpuStream,
    "Event": CpuEvent,
    "current_stream": _current_stream,
    "default_stream": _current_stream,
    "stream": _stream,
    "synchronize": _synchronize,
}


def check_preconditions() -> None:
    """Version, the torch.cuda names being stubbed, and the dispatcher's class-level stream."""
    compat.require_version(SUPPORTED)
    for name in STUBBED:
        compat.check_attr(torch.cuda, name)
    from megatron.core.transformer.moe import token_dispatcher

    compat.check_attr(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream")


def is_applied() -> bool:
    return compat.is_marked(torch.cuda.Stream, NAME)


def apply() -> None:
    """Install the no-op stubs on torch.cuda. Idempotent."""
    if is_applied():
        return
    check_preconditions()
    compat.require_no_cuda(NAME)
    for name, stub in _STUBS.items():
        setattr(torch.cuda, name, compat.mark(stub, NAME))
    logger.info("applied megatron patch %s", NAME)
