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


COMPILE_SCRIPT = r"""
import json, sys
import torch
from moe_rl.lazy_imports import defer_megatron_compile
out = {"deferred": defer_megatron_compile(), "again": defer_megatron_compile()}
import megatron.core.jit as jit
import megatron.core.fusions.fused_bias_swiglu as fused
loaded = [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]
out["compile_imported_by_megatron"] = loaded
out["torch_compile_restored"] = torch.compile.__module__ == "torch"
out["jit_fuser_is_stand_in"] = jit.jit_fuser is not torch.compile
y = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
want = torch.nn.functional.silu(y[:, :4]) * y[:, 4:]  # swiglu in eager ATen ops: bit for bit
out["cpu_equal"] = torch.equal(fused.swiglu(y), want)
out["cpu_still_no_dynamo"] = "torch._dynamo" in sys.modules
import moe_rl.lazy_imports as lazy
lazy.compiles_here = lambda: True  # what a CUDA machine answers: the real torch.compile runs
z = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
got = fused.bias_swiglu(z, torch.zeros(8))  # a function not called yet: compiled at this call
out["cuda_path_compiled"] = "torch._dynamo" in sys.modules
out["cuda_path_close"] = torch.allclose(got, z[:, :4] * torch.sigmoid(z[:, :4]) * z[:, 4:], atol=1e-6)
print(json.dumps(out))
"""


@pytest.mark.unit
def test_megatron_fusions_run_eagerly_on_the_cpu_and_compile_at_first_call_on_cuda():
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "deferred": True,
        "again": False,  # the hook is in place: nothing done
        "compile_imported_by_megatron": [],
        "torch_compile_restored": True,
        "jit_fuser_is_stand_in": True,
        "cpu_equal": True,
        "cpu_still_no_dynamo": False,
        "cuda_path_compiled": True,
        "cuda_path_close": True,
    }
