"""What is on the device at each phase of a step: the one owner of the offload timeline (issue 41;
docs/design.md 14.2, docs/gpu_stack.md 7.1).

A learner rank's step, phase by phase (``parallel.offload_during_rollout`` and the engine's sleep
mode, ``rollout.vllm.sleep_level``), in the estimate's order (``COLOCATED_ORDER``,
``moe_rl/memory/phases.py``: train, offload, engine_wake, sync, learner_out, kv_wake, generate):

    start_engine     once: the engine starts while the learner's state is on the host (vLLM
                     reserves its share of the device as it starts), then sleeps
    syncing          after the update (and before the first rollout): the optimizer state, main
                     params and grads leave the device (``offload``; the sync reads none of them);
                     the engine's weights wake (``engine_wake``; its KV cache stays asleep) and
                     take the learner's bf16 weights a bounded piece at a time (``sync``,
                     ``moe_rl/pipeline/weight_sync.py``); the learner's weights leave
                     (``learner_out``)
    before_generate  whatever of the learner is still on the device leaves (nothing after a sync;
                     a checkpoint put it back in between); the engine's KV cache wakes (``kv_wake``)
    after_generate   the engine sleeps; the learner's state comes back (``reload``) for the
                     old-log-prob pass, the reference pass and the update (``train``)

``syncing`` and ``generating`` wrap the sync and the rollout in those phases; ``resident`` brings
the weights and optimizer state (not the grads: no checkpoint holds them) back around a checkpoint
and parks them again after it; ``finish`` brings everything back at the end of the run. Each phase
that moves something is a span of the memory timeline: through the step's ``phase`` recorder
(``StepTimer.phase``: ``time/offload_s``, ``time/sync_s``, ``time/learner_out_s``) or the rank's
``MemoryTimeline`` (``reload``). Without offload nothing of the learner moves and only the sync is
recorded, as before.

The order lives here and nowhere else; what moves is ``moe_rl/learner/offload.py``'s
(``ParkedState``: storages by kind, wrapped, not copied); what an engine can put to sleep is its own
(``sleep``, ``wake_weights``, ``wake_cache``: the vLLM engine; the built-in engine has none). A
rollout rank's timeline has no learner: its engine still sleeps after each generate call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from moe_rl.learner.offload import KINDS, RESIDENT, TRAIN_STATE, OffloadedBytes, ParkedState, offloaded

Phase = Callable[[str], contextlib.AbstractContextManager]  # StepTimer.phase: records a named phase


def _untimed(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _call(engine, name: str) -> None:
    """The engine's phase hook ``name`` where it has one (engines without sleep mode have none)."""
    hook = getattr(engine, name, None)
    if hook is not None:
        hook()


class OffloadTimeline:
    """One rank's offload timeline (see the module docstring). ``learner``: None on a rollout rank;
    ``offload``: ``parallel.offload_during_rollout``; ``memory``: the rank's ``MemoryTimeline``
    (the ``reload`` span)."""

    def __init__(self, engine, learner=None, offload: bool = False, memory=None) -> None:
        self.engine, self.learner, self.memory = engine, learner, memory
        self.offload = offload and learner is not None
        self.parked = ParkedState(learner) if self.offload else None

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

    # ---- around the weight sync ---------------------------------------------------------------
    @contextlib.contextmanager
    def syncing(self, phase: Phase | None = None) -> Iterator[None]:
        """The sync's phases around the sync inside: the optimizer state, main params and grads
        leave (``offload``; the sync reads none of them); the engine's weights wake and the sync
        runs (``sync``); the learner's weights leave (``learner_out``: the engine holds its own
        copy now). An exception inside skips ``learner_out`` (the run ends; ``finish``).
        ``phase``: the step's recorder (``StepTimer.phase``; None: nothing is recorded)."""
        phase = phase or _untimed
        if self.offload:
            with phase("offload"):
                self.parked.offload(TRAIN_STATE)
        with phase("sync"):
            _call(self.engine, "wake_weights")  # its KV cache stays asleep
            yield
        if self.offload:
            with phase("learner_out"):
                self.parked.offload(("params",))

    # ---- around the rollout -------------------------------------------------------------------
    def before_generate(self) -> OffloadedBytes:
        """What is left of the learner leaves the device; the engine's KV cache wakes. Returns the
        bytes off the device, per kind (zeros without offload)."""
        moved = OffloadedBytes()
        if self.offload:
            self.parked.offload(KINDS)
            moved = self.parked.moved
        _call(self.engine, "wake_cache")
        return moved

    def after_generate(self, step: int | None = None) -> None:
        """The engine sleeps; the learner's state comes back (``reload``)."""
        try:
            _call(self.engine, "sleep")
        finally:
            if self.offload:
                with self._span("reload", step):
                    self.parked.reload()

    @contextlib.contextmanager
    def generating(self, step: int | None = None) -> Iterator[OffloadedBytes]:
        """``before_generate`` ... ``after_generate`` around the rollout (validation included);
        the learner's state comes back also on an exception (a checkpoint or a clean end may
        follow)."""
        moved = self.before_generate()
        try:
            yield moved
        finally:
            self.after_generate(step)

    # ---- between a sync and the next rollout --------------------------------------------------
    @contextlib.contextmanager
    def resident(self, kinds: tuple[str, ...] = RESIDENT) -> Iterator[None]:
        """The parked storages of ``kinds`` on the device inside (a checkpoint), parked again after."""
        was = tuple(k for k in (self.parked.kinds if self.offload else ()) if k in kinds)
        if was:
            self.parked.reload(was)
        try:
            yield
        finally:
            if was:
                self.parked.offload(was)

    def finish(self) -> None:
        """The end of the run: everything the last sync parked comes back."""
        if self.offload:
            self.parked.reload()

    def _span(self, name: str, step: int | None):
        return self.memory.span(name, step) if self.memory is not None else contextlib.nullcontext()
