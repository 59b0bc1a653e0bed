"""Imports that upstream makes at import time and a rank never uses: deferred to first use.

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

import importlib
import importlib.util
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
