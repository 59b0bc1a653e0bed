"""Imports that upstream makes at import time and a rank never uses: deferred to first use
(wandb's), or not needed on the CPU (megatron's torch.compile: ``defer_megatron_compile``).

megatron-core imports ``wandb`` in three modules (``timers``, the inference engine and context)
only to bind the name for optional logging. The import costs about 2 s of CPU per rank (a sixth
of a rank's imports on the 2-core CI machine), in every rank of every launch, while moe-rl needs
wandb in rank 0 alone, and only with ``log.wandb_mode`` other than ``disabled``.

``defer_wandb`` puts a stand-in module in ``sys.modules``: ``import wandb`` binds it at no cost,
and the first read of an attribute it lacks (``wandb.init`` in moe_rl/metrics.py) runs the real
import, copies the real module's namespace into the stand-in (so names bound to it before work)
and leaves the real module in ``sys.modules``. The stand-in carries ``__file__``, ``__path__`` and
``__spec__`` itself: torch's custom-op registration calls ``inspect.getmodule``, which reads
``__file__`` of every module in ``sys.modules`` (``importlib.util.LazyLoader`` would load there)."""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import sys
import types


class _Deferred(types.ModuleType):
    def __getattr__(self, name: str):  # only for names the stand-in lacks
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        real = importlib.import_module(self.__name__)
        self.__dict__.update(real.__dict__)
        return getattr(real, name)


def defer_wandb() -> bool:
    """Make ``import wandb`` bind a stand-in that imports wandb at first use; False (nothing done)
    if wandb is already imported or not installed. Call before importing megatron."""
    if "wandb" in sys.modules:
        return False
    spec = importlib.util.find_spec("wandb")
    if spec is None or spec.origin is None:
        return False
    module = _Deferred("wandb")
    module.__file__, module.__spec__ = spec.origin, spec
    if spec.submodule_search_locations is not None:
        module.__path__ = list(spec.submodule_search_locations)
    sys.modules["wandb"] = module
    return True


def compiles_here() -> bool:
    """Whether megatron's fused functions are compiled in this process: on a CUDA machine."""
    import torch

    return torch.cuda.is_available()


def _compile_where_it_pays(real_compile):
    """A stand-in for ``torch.compile`` with its signature. A function it decorates runs as it is on
    the CPU (megatron.core.jit's own ``noop_decorator``, what its ``disable_jit_fuser`` gives) and is
    compiled by the real ``torch.compile``, with the same arguments, at its first call on a CUDA
    machine (torch compiles at the first call anyway: only the import of torch._dynamo and
    torch._inductor moves there)."""

    def compile_(model=None, **kwargs):
        if model is None:  # used as @torch.compile(mode=...)
            return functools.partial(compile_, **kwargs)
        if not inspect.isfunction(model):  # a module: returned as torch returns it
            return real_compile(model, **kwargs)
        run = None

        @functools.wraps(model)
        def compiled_at_first_call_on_cuda(*args, **kw):
            nonlocal run
            if run is None:
                run = real_compile(model, **kwargs) if compiles_here() else model
            return run(*args, **kw)

        return compiled_at_first_call_on_cuda

    return compile_


class _JitUnderStandIn(importlib.abc.Loader):
    """Runs megatron.core.jit's own code with ``torch.compile`` replaced by the stand-in for that
    module's execution only: ``jit_fuser`` keeps the stand-in, nothing else does."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        import torch

        real_compile = torch.compile
        torch.compile = _compile_where_it_pays(real_compile)
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = real_compile


class _FindJit(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MEGATRON_JIT:
            return None
        sys.meta_path.remove(self)  # once: the real finders locate the module
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _JitUnderStandIn(spec.loader)
        return spec


MEGATRON_JIT = "megatron.core.jit"


def defer_megatron_compile() -> bool:
    """Make megatron-core's fused functions run eagerly on the CPU and compile at their first call
    on CUDA; False (nothing done) if megatron.core.jit is imported already. Imports nothing: it
    installs an import hook for megatron.core.jit. Call before importing megatron.

    Why: megatron.core.jit binds ``jit_fuser = torch.compile`` and megatron decorates a dozen
    functions with it at import time (swiglu, the router's expert-bias update, the alltoall
    dispatcher's preprocessing, the norm), which imports torch._dynamo and torch._inductor (about
    3.5 s of CPU per rank on the 2-core CI machine), and every rank of every CPU run then traced and
    compiled them with inductor (a C++ build when its cache is cold) for element-wise ops on tiny
    tensors: 0.85x the CPU of a 6-step run (docs/megatron_cpu.md 5)."""
    if MEGATRON_JIT in sys.modules or any(isinstance(f, _FindJit) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _FindJit())
    return True
