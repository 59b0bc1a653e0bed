"""moe_rl/lazy_imports.py: megatron's unused ``import wandb`` costs nothing until wandb is used,
and then every name bound to the stand-in sees the real module. In a subprocess: the test process
keeps its own sys.modules."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, time
from moe_rl.lazy_imports import defer_wandb
out = {"deferred": defer_wandb(), "again": defer_wandb()}
import megatron.core.timers as timers
import megatron.core.inference.contexts.dynamic_context as dc
out["loaded_by_megatron"] = sorted(m for m in sys.modules if m.startswith("wandb."))
out["file"] = hasattr(sys.modules["wandb"], "__file__")  # inspect.getmodule reads it: no import
out["loaded_by_file"] = "wandb.sdk" in sys.modules
import wandb
init = wandb.init  # first use: the real import
out["real_in_sys_modules"] = type(sys.modules["wandb"]).__name__
out["same_init"] = dc.wandb.init is init is sys.modules["wandb"].init
out["timers_sees_real"] = timers.wandb.Settings is sys.modules["wandb"].Settings
out["version"] = wandb.__version__ == sys.modules["wandb"].__version__
print(json.dumps(out))
"""


@pytest.mark.unit
def test_megatron_binds_a_stand_in_and_the_first_use_imports_wandb():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "deferred": True,
        "again": False,  # already in sys.modules: nothing done
        "loaded_by_megatron": [],
        "file": True,
        "loaded_by_file": False,
        "real_in_sys_modules": "module",
        "same_init": True,
        "timers_sees_real": True,
        "version": True,
    }
