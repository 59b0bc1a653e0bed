"""The learner's state off the device while the rollout engine generates
(``parallel.offload_during_rollout``; docs/gpu_stack.md 7.1): the mechanism, storages moved by kind
(``ParkedState``; ``offloaded`` moves every kind at once). When each kind moves is the offload
timeline's (``moe_rl/pipeline/offload_timeline.py``, docs/design.md 14.2).

What moves, per rank, each storage once (views share it):

    optimizer    Adam's ``exp_avg`` and ``exp_avg_sq`` of every parameter the optimizer steps
                 (the distributed optimizer's shard: 2 x 4 bytes x the rank's shard numel)
    main_params  the fp32 main parameters when they are their own storage (bf16 models; in fp32
                 the optimizer steps views of the model's parameters, counted as ``params``)
    params       the model's parameter storages (megatron DDP's param buffers under the
                 distributed optimizer, each parameter's own storage without it): every engine
                 holds its own copy of the weights (the built-in engine's model, vLLM's), filled
                 by the weight sync before generation
    grads        megatron DDP's gradient buffers (``grad_data``, fp32: grad_reduce_in_fp32),
                 dense and expert-parallel; their contents are dropped, not copied, and they come
                 back zeroed, as megatron-core's own ``_ParamAndGradBuffer.offload_to_cpu`` does:
                 every update starts with ``zero_grad_buffer``

How: each storage is copied into a host buffer (pinned on CUDA) and its ``untyped_storage()`` is
resized to 0 bytes; on the way back it is resized and copied in. Every tensor viewing it (the
parameters, ``main_grad``, the optimizer's shard views) sees the same storage again, so nothing is
re-pointed, and a use while offloaded fails loudly (a zero-byte storage). The same code runs on
CPU tensors, where "device memory" is the original storage and the host buffer a separate
allocation: the freed bytes are real and countable, and CI tests them.

Why not megatron-core 0.16.1's own calls: ``MegatronOptimizer.offload_to_cpu`` moves only tensors
that are ``is_cuda`` (a no-op on the CPU) and rebinds ``p.data`` and the state dict entries (new
tensors: views held elsewhere, e.g. the distributed optimizer's shard views, would go stale), and
``_ParamAndGradBuffer.offload_to_cpu`` pins with ``Tensor.pin_memory()``, which needs CUDA. The
storage resize is the one they use for the buffers; this module applies it to all four kinds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from moe_rl.metrics import Max

KINDS = ("params", "main_params", "grads", "optimizer")
TRAIN_STATE = ("optimizer", "main_params", "grads")  # what the weight sync does not read
RESIDENT = ("params", "main_params", "optimizer")  # what a checkpoint reads (grads it does not)
OPTIMIZER_STATE = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class OffloadedBytes:
    """Bytes this rank moved off the device, per kind (0 everywhere when offload is off)."""

    params: int = 0
    main_params: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def metrics(self) -> dict:
        """``mem/offloaded_<kind>_gib``, the largest rank's; none when nothing moved (offload off)."""
        if not self.total:
            return {}
        return {f"mem/offloaded_{f.name}_gib": Max(getattr(self, f.name) / 2**30) for f in fields(self)}


@dataclass
class _Parked:
    kind: str
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # None: the contents are dropped (grads) and come back zeroed


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers under megatron's (chained: dense and expert) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    megatron_opts = chained if chained is not None else [optimizer]
    return [m.optimizer for m in megatron_opts if getattr(m, "optimizer", None) is not None]


def learner_storages(
    ddp, optimizer, device: torch.device, kinds: tuple[str, ...] = KINDS
) -> list[tuple[str, torch.UntypedStorage]]:
    """(kind, storage) of everything offload moves, only of ``kinds``: each storage once, only
    those on ``device`` (with ``optim.cpu_adam`` the optimizer's own tensors already live on the
    host) and holding bytes (an offloaded one holds none)."""
    seen: set[int] = set()
    out: list[tuple[str, torch.UntypedStorage]] = []

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None or t.device != device:
            return
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            return
        seen.add(st.data_ptr())
        out.append((kind, st))

    model_params = list(ddp.parameters())
    inner = _inner_optimizers(optimizer)
    for opt in inner:
        for state in opt.state.values():
            for key in OPTIMIZER_STATE:
                add("optimizer", state.get(key))
    model_ptrs = {p.untyped_storage().data_ptr() for p in model_params}
    for opt in inner:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in model_ptrs:
                    add("main_params", p)
    for p in model_params:
        add("params", p)
    for buf in [*ddp.buffers, *ddp.expert_parallel_buffers]:
        add("grads", buf.grad_data)
    return [(kind, st) for kind, st in out if kind in kinds]


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def offload(storages: list[tuple[str, torch.UntypedStorage]]) -> list[_Parked]:
    """Copy each storage to the host (grads: drop) and free it on the device."""
    cuda = any(st.device.type == "cuda" for _, st in storages)
    parked = []
    for kind, st in storages:
        host = None
        if kind != "grads":
            host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=st.device.type == "cuda")
            host.copy_(_byte_view(st), non_blocking=True)
        parked.append(_Parked(kind, st, st.nbytes(), host))
    if cuda:
        torch.cuda.synchronize()  # the copies are done before their sources are freed
    for p in parked:
        p.storage.resize_(0)
    if cuda:
        torch.cuda.empty_cache()  # the engine (vLLM's pool) can take the freed memory
    return parked


def reload(parked: list[_Parked]) -> None:
    """Every storage back at its size, with its bytes (grads: zeros)."""
    for p in parked:
        p.storage.resize_(p.nbytes)
        view = _byte_view(p.storage)
        if p.host is None:
            view.zero_()
        else:
            view.copy_(p.host, non_blocking=True)
    if any(p.storage.device.type == "cuda" for p in parked):
        torch.cuda.synchronize()  # the host buffers are freed on return


def moved_bytes(parked: list[_Parked]) -> OffloadedBytes:
    return OffloadedBytes(**{k: sum(p.nbytes for p in parked if p.kind == k) for k in KINDS})


@contextlib.contextmanager
def offloaded(learner, enabled: bool) -> Iterator[OffloadedBytes]:
    """``with offloaded(learner, cfg.parallel.offload_during_rollout) as moved:`` the learner's
    storages are off the device inside, back (also on an exception: a checkpoint or a clean end
    may follow) when it exits; ``moved`` says how many bytes of each kind left."""
    if not enabled:
        yield OffloadedBytes()
        return
    state = ParkedState(learner)
    moved = state.offload()
    try:
        yield moved
    finally:
        state.reload()


class ParkedState:
    """One learner's storages off the device, moved by kind (``KINDS``) in any order:
    ``offload(kinds)`` parks those of ``kinds`` still on the device, ``reload(kinds)`` brings
    those back, ``moved`` says what is off now. The order is the caller's (the offload timeline)."""

    def __init__(self, learner) -> None:
        self.learner = learner
        self.parked: list[_Parked] = []

    def offload(self, kinds: tuple[str, ...] = KINDS) -> OffloadedBytes:
        """Move the storages of ``kinds`` still on the device to the host; the bytes moved now."""
        lr = self.learner
        now = offload(learner_storages(lr.ddp, lr.optimizer, lr.device, kinds))
        self.parked += now
        return moved_bytes(now)

    def reload(self, kinds: tuple[str, ...] = KINDS) -> None:
        """Bring back every parked storage of ``kinds``."""
        back = [p for p in self.parked if p.kind in kinds]
        self.parked = [p for p in self.parked if p.kind not in kinds]
        reload(back)

    @property
    def moved(self) -> OffloadedBytes:
        """The bytes off the device now, per kind."""
        return moved_bytes(self.parked)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds with a storage off the device now."""
        return tuple(k for k in KINDS if any(p.kind == k for p in self.parked))
