"""Carry a synchronous checkpoint save's write results in-process, without a Manager process.

Target: megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue
    (called by ``FileSystemWriterAsync.prepare_write_data`` on every rank with data to write).
Why: upstream makes the queue with ``mp.get_context("spawn").Manager().Queue()``, once per
    process, at the first save: a server process per rank that imports the rank's main module
    again (torch and moe-rl's CLI: 2-3 s of CPU per rank on the 2-core CI machine, more than the
    tiny model's whole save) and lives until the job ends. moe-rl saves synchronously
    (``dist_checkpointing.save`` without ``async_sharded_save``): the writer function puts its
    results and ``retrieve_write_results`` reads them in the same process, so a ``queue.Queue``
    carries them. Not a bug; a cost, on CPU and GPU.
Remove when: upstream makes the queue only for asynchronous saves (still a spawn Manager in
    0.19.2).

Loud where it cannot hold: a put from another process (an asynchronous save's forked writer)
raises PatchError there, and the saving rank then gets megatron's own "results_queue should not
be empty" error; pickling the queue (a spawned or persistent writer) raises PatchError.
"""

from __future__ import annotations

import logging
import os
import queue
import types
from typing import Any

from megatron_patches import compat

logger = logging.getLogger(__name__)

NAME = "save_results_queue"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = False
KIND = "a process per rank at the first save (cost, not a bug; CPU and GPU)"
EXPECTED_PARAMS: tuple[str, ...] = ()


class InProcessResults(queue.Queue):
    """The write results of this process's synchronous saves; refuses other processes."""

    def __init__(self) -> None:
        super().__init__()
        self.pid = os.getpid()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if os.getpid() != self.pid:
            raise compat.PatchError(
                f"{NAME}: a checkpoint writer in process {os.getpid()} put its results into rank "
                f"process {self.pid}'s in-process queue: asynchronous saves need upstream's "
                "Manager queue (megatron_patches/save_results_queue.py)"
            )
        super().put(item, block, timeout)

    def __reduce__(self):
        raise compat.PatchError(
            f"{NAME}: the write-results queue was pickled for another process (an asynchronous "
            "save): moe-rl saves synchronously (megatron_patches/save_results_queue.py)"
        )


def _module() -> types.ModuleType:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async


def check_preconditions() -> None:
    """Version; the queue getter takes no arguments, the module-level cache exists, and the
    writer reads the queue with ``get_nowait`` (a missing result is upstream's error, not a hang)."""
    compat.require_version(SUPPORTED)
    mod = _module()
    compat.check_signature(compat.check_attr(mod, "_get_write_results_queue"), EXPECTED_PARAMS)
    compat.check_attr(mod, "_results_queue")
    writer = compat.check_attr(mod, "FileSystemWriterAsync")
    import inspect

    if "get_nowait" not in inspect.getsource(compat.check_attr(writer, "retrieve_write_results")):
        raise compat.PatchError("FileSystemWriterAsync.retrieve_write_results no longer uses get_nowait")


def _results_queue() -> InProcessResults:
    """One queue per process, as upstream keeps one Manager queue per process."""
    mod = _module()
    if not isinstance(mod._results_queue, InProcessResults) or mod._results_queue.pid != os.getpid():
        mod._results_queue = InProcessResults()
    return mod._results_queue


def is_applied() -> bool:
    return compat.is_marked(_module()._get_write_results_queue, NAME)


def apply() -> None:
    """Replace the getter (upstream's body is the Manager start this patch avoids). Idempotent."""
    if is_applied():
        return
    check_preconditions()
    mod = _module()

    def _get_write_results_queue() -> InProcessResults:
        return _results_queue()

    _get_write_results_queue.__wrapped__ = mod._get_write_results_queue  # upstream, for readers
    mod._get_write_results_queue = compat.mark(_get_write_results_queue, NAME)
    logger.info("applied megatron patch %s", NAME)
