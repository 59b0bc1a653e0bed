"""Runtime patches for megatron-core, applied explicitly: nothing runs at import.

Two groups, each an ordered tuple of module names in this package:

- ``CPU_PATCHES``: shims that let megatron-core run on a CPU-only torch build over gloo
  (see docs/megatron_cpu.md). ``apply_all`` applies them only when CUDA is absent.
- ``ALWAYS_PATCHES``: fixes for upstream bugs that also hit GPU runs; always applied.

Every patch module exposes ``NAME``, ``SUPPORTED`` (a PEP 440 specifier of megatron-core
versions), ``CPU_ONLY`` (True: its ``apply`` raises PatchError on a CUDA build),
``check_preconditions()`` (version + signature/attribute checks; raises PatchError),
``apply()`` (idempotent; checks first) and ``is_applied()``. A patch that may be fixed upstream
also has ``needed() -> (bool, reason)``; when it returns False, ``apply_all`` skips it.

Call ``apply_all()`` once per process, after importing torch and before building models.
Importing this package imports neither torch nor megatron.
"""

from __future__ import annotations

import importlib
import logging
import types

from megatron_patches.compat import MCORE_VERSION, PatchError

logger = logging.getLogger(__name__)

__all__ = [
    "ALL_PATCHES",
    "ALWAYS_PATCHES",
    "CPU_PATCHES",
    "MCORE_VERSION",
    "PatchError",
    "apply_all",
    "check_all",
    "get_patch",
    "plan",
]

CPU_PATCHES: tuple[str, ...] = (
    "cuda_stream",
    "current_device",
    "causal_mask",
    "rng_tracker",
    "te_names",
    "a2a_splits",
    "gloo_uneven_gather",
    "cuda_factories",
    "tensor_type_strings",
    "distopt_ckpt",
)
ALWAYS_PATCHES: tuple[str, ...] = ("distopt_step_alias", "router_replay_hook", "save_results_queue")
ALL_PATCHES: tuple[str, ...] = CPU_PATCHES + ALWAYS_PATCHES


def get_patch(name: str) -> types.ModuleType:
    """The patch module called ``name`` (imported on first use)."""
    if name not in ALL_PATCHES:
        raise KeyError(f"unknown megatron patch {name!r}; known: {list(ALL_PATCHES)}")
    return importlib.import_module(f"{__name__}.{name}")


def _cuda(cuda_available: bool | None) -> bool:
    if cuda_available is not None:
        return cuda_available
    import torch

    return torch.cuda.is_available()


def _selected(cuda_available: bool) -> tuple[str, ...]:
    # one fixed order, the same as ALL_PATCHES and plan(): CPU shims, then always-on fixes
    return ALWAYS_PATCHES if cuda_available else CPU_PATCHES + ALWAYS_PATCHES


def _needed(patch: types.ModuleType) -> tuple[bool, str]:
    needed = getattr(patch, "needed", None)
    return needed() if needed is not None else (True, "")


def apply_all(cuda_available: bool | None = None) -> list[str]:
    """Apply ALWAYS_PATCHES, plus CPU_PATCHES when CUDA is not available.

    Args:
        cuda_available: override for ``torch.cuda.is_available()`` (tests, planning).

    Returns:
        the names of the patches in effect after the call, in application order (patches
        already applied by an earlier call are included; ones reported not needed are not).

    Raises:
        PatchError: a patch's version/signature check failed, or a CPU-only shim was
            requested on a CUDA build. Patches before it in the order stay applied.
    """
    applied = []
    for name in _selected(_cuda(cuda_available)):
        patch = get_patch(name)
        if not patch.is_applied():
            is_needed, reason = _needed(patch)
            if not is_needed:
                logger.info("megatron patch %s not needed: %s", name, reason)
                continue
            patch.apply()
        applied.append(name)
    logger.info("megatron patches in effect (megatron-core %s): %s", MCORE_VERSION, applied)
    return applied


def _plan_row(name: str, cuda_available: bool) -> tuple[str, bool, str]:
    patch = get_patch(name)
    if name in CPU_PATCHES and cuda_available:
        return name, False, "CPU shim; CUDA is available"
    if patch.is_applied():
        return name, True, "already applied"
    is_needed, reason = _needed(patch)
    if not is_needed:
        return name, False, f"not needed: {reason}"
    kind = (
        "CPU shim; no CUDA" if name in CPU_PATCHES else getattr(patch, "KIND", "upstream bug on CPU and GPU")
    )
    return name, True, f"{kind} (megatron-core {MCORE_VERSION}, supports {patch.SUPPORTED})"


def plan(cuda_available: bool | None = None) -> list[tuple[str, bool, str]]:
    """What ``apply_all`` would do: ``(name, would_apply, reason)`` for every known patch.

    Runs no precondition checks (see ``check_all``); only a patch's ``needed()`` hook.
    """
    cuda = _cuda(cuda_available)
    return [_plan_row(name, cuda) for name in ALL_PATCHES]


def check_all() -> list[str]:
    """Run every patch's ``check_preconditions()``; applies nothing.

    Returns:
        the names checked, in order.

    Raises:
        PatchError: listing every patch whose check failed, with its message.
    """
    failures = []
    for name in ALL_PATCHES:
        try:
            get_patch(name).check_preconditions()
        except PatchError as err:
            failures.append(f"{name}: {err}")
    if failures:
        raise PatchError("megatron patch preconditions failed:\n  " + "\n  ".join(failures))
    return list(ALL_PATCHES)
