"""Run megatron's CUDA RNG tracker on the CPU generator.

Target: megatron.core.tensor_parallel.random: ``_get_cuda_rng_state``, ``_set_cuda_rng_state``
    (used by CudaRNGStatesTracker.fork, _fork_rng and activation recompute) and the module's
    ``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed`` calls (CudaRNGStatesTracker.add,
    model_parallel_cuda_manual_seed).
Why: ``model_parallel_cuda_manual_seed`` raises ``AssertionError: Torch not compiled with CUDA
    enabled`` at ``torch.cuda.get_rng_state()``; without it, dropout and expert init raise
    ``Exception: cuda rng state model-parallel-rng is not added``. And upstream
    ``_set_cuda_rng_state`` would silently do nothing on a CPU build (its write is queued by
    ``torch.cuda._lazy_call`` for a CUDA init that never happens).
Remove when: megatron-core's tracker supports a CPU generator (not in 0.19.2). CPU-only:
    applying it on a CUDA build raises PatchError.

On a CPU build the "CUDA default generator" of megatron's design *is* the CPU default
generator (dropout draws from it), so the shim maps the two accessors to
``torch.get_rng_state`` / ``torch.set_rng_state`` and gives random.py a ``torch.cuda`` whose
``get_rng_state``/``manual_seed``/``set_rng_state`` act on the CPU generator. The tracker class
itself (add, fork, the named data/model/expert-parallel states) runs unchanged.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from megatron_patches import compat, torch_proxy

logger = logging.getLogger(__name__)

NAME = "rng_tracker"
SUPPORTED = ">=0.16.1,<0.20"
CPU_ONLY = True
EXPECTED_PARAMS = {
    "_get_cuda_rng_state": ("device", "clone", "graph_safe"),
    "_set_cuda_rng_state": ("new_state", "device", "graph_safe"),
    "model_parallel_cuda_manual_seed": (
        "seed",
        "te_rng_tracker",
        "inference_rng_tracker",
        "use_cudagraphable_rng",
        "tp_rank",
        "ep_rank",
        "etp_rank",
        "force_reset_rng",
    ),
}
TRACKER_PARAMS = {"add": ("self", "name", "seed"), "fork": ("self", "name")}
# CudaRNGStatesTracker.fork warns when the CPU generator moved inside a fork; on CPU the forked
# generator IS the CPU generator, so every fork that draws (dropout, init) would log it.
SPURIOUS_WARNING = "CPU RNG state changed within GPU RNG context"


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    if graph_safe:
        raise NotImplementedError("graph-safe (CUDA graph) RNG states do not exist on CPU")
    return torch.get_rng_state()  # always a fresh tensor, so `clone` holds trivially


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    if graph_safe:
        raise NotImplementedError("graph-safe (CUDA graph) RNG states do not exist on CPU")
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


class _DropSpuriousWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != SPURIOUS_WARNING


def _random_module() -> types.ModuleType:
    from megatron.core.tensor_parallel import random

    return random


def check_preconditions() -> None:
    """Version, the two accessors' signatures, the tracker methods, and the torch global."""
    compat.require_version(SUPPORTED)
    random = _random_module()
    torch_proxy.check_module_uses_torch(random)
    for name, params in EXPECTED_PARAMS.items():
        compat.check_signature(compat.check_attr(random, name), params)
    tracker_cls = compat.check_attr(random, "CudaRNGStatesTracker")
    for name, params in TRACKER_PARAMS.items():
        compat.check_signature(compat.check_attr(tracker_cls, name), params)


def is_applied() -> bool:
    return compat.is_marked(_random_module()._set_cuda_rng_state, NAME)


def _cpu_cuda_namespace() -> types.ModuleType:
    """torch.cuda as random.py should see it: RNG calls go to the CPU generator."""
    overrides = {
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        "manual_seed": _cpu_manual_seed,
    }
    return torch_proxy.TorchProxy(torch.cuda, NAME, overrides, name="torch.cuda")


def apply() -> None:
    """Point random.py's CUDA RNG accessors at the CPU generator. Idempotent."""
    if is_applied():
        return
    check_preconditions()
    compat.require_no_cuda(NAME)
    random = _random_module()
    torch_proxy.install(random, NAME, extra={"cuda": _cpu_cuda_namespace()})
    for name, replacement in (
        ("_get_cuda_rng_state", _get_cpu_rng_state),
        ("_set_cuda_rng_state", _set_cpu_rng_state),
    ):
        replacement.__wrapped__ = getattr(random, name)  # type: ignore[attr-defined]
        setattr(random, name, compat.mark(replacement, NAME))
    logging.getLogger(random.__name__).addFilter(_DropSpuriousWarning())
    logger.info("applied megatron patch %s", NAME)
