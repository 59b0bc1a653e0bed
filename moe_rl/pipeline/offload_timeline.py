"""What is on the device at each phase of a step: the one owner of the offload timeline (issue 41;
docs/design.md 14.2, docs/gpu_stack.md 7.1).

A learner rank's step, phase by phase (``parallel.offload_during_rollout`` and the engine's sleep
mode, ``rollout.vllm.sleep_level``):

    start_engine     the engine starts while the learner's state is on the host (vLLM reserves its
                     share of the device as it starts), then sleeps
    before_generate  the learner's state leaves the device; the engine's KV cache wakes
    after_generate   the engine sleeps; the learner's state comes back (train, update)
    before_sync      the engine's weights wake (its KV cache stays asleep)
    after_sync       nothing moves yet

Each phase is a method, so the order (e.g. optimizer state and grads leaving before the sync,
the learner's weights after it: issue 41 point 2) changes here and nowhere else. What moves is
``moe_rl/learner/offload.py``'s (wrapped, not copied); what an engine can put to sleep is its own
(``sleep``, ``wake_weights``, ``wake_cache``: the vLLM engine; the built-in engine has none).
A rollout rank's timeline has no learner: its engine still sleeps after each generate call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from moe_rl.learner.offload import OffloadedBytes, offloaded


def _call(engine, name: str) -> None:
    """The engine's phase hook ``name`` where it has one (engines without sleep mode have none)."""
    hook = getattr(engine, name, None)
    if hook is not None:
        hook()


class OffloadTimeline:
    """One rank's offload timeline (see the module docstring). ``learner``: None on a rollout rank;
    ``offload``: ``parallel.offload_during_rollout``."""

    def __init__(self, engine, learner=None, offload: bool = False) -> None:
        self.engine, self.learner = engine, learner
        self.offload = offload and learner is not None
        self._parked: contextlib.ExitStack | None = None

    def start_engine(self) -> None:
        """Start an engine that reserves device memory as it starts (vLLM) beside no learner state,
        then put it to sleep. Engines without ``start`` (built-in) start at the first sync."""
        if not self.offload or not hasattr(self.engine, "start"):
            return
        named = None  # vLLM reads a named HF dir; else host copies (small models: the smoke test)
        if not self.engine.starts_from_dir():
            named = {k: t.detach().to("cpu", copy=True) for k, t in self.learner.export_canonical().items()}
        with offloaded(self.learner, True):
            self.engine.start(named)
            _call(self.engine, "sleep")

    def before_generate(self) -> OffloadedBytes:
        """The learner's state leaves the device; the engine's KV cache wakes. Returns the bytes
        moved, per kind (zeros without offload)."""
        stack = contextlib.ExitStack()
        moved = stack.enter_context(offloaded(self.learner, self.offload))
        self._parked = stack
        _call(self.engine, "wake_cache")
        return moved

    def after_generate(self) -> None:
        """The engine sleeps; the learner's state comes back."""
        try:
            _call(self.engine, "sleep")
        finally:
            if self._parked is not None:
                self._parked.close()
                self._parked = None

    @contextlib.contextmanager
    def generating(self) -> Iterator[OffloadedBytes]:
        """``before_generate`` ... ``after_generate`` around the rollout (validation included);
        the learner's state comes back also on an exception (a checkpoint or a clean end may
        follow)."""
        moved = self.before_generate()
        try:
            yield moved
        finally:
            self.after_generate()

    def before_sync(self) -> None:
        """The engine's weights wake, to be overwritten by the sync."""
        _call(self.engine, "wake_weights")

    def after_sync(self) -> None:
        """Nothing moves after the sync yet (the phased order of issue 41 point 2 lands here)."""
