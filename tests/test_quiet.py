"""moe_rl/quiet.py silences exactly the listed messages: by message, category and module for
warnings, by exact text and logger for log records; anything else still prints."""

from __future__ import annotations

import logging
import os
import warnings

import pytest

from moe_rl.quiet import silence_known_noise


def _shown(message: str, category: type[Warning], module: str) -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        silence_known_noise()
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module)
    return len(seen) == 1


@pytest.mark.unit
def test_warnings_are_silenced_by_message_category_and_module(monkeypatch):
    monkeypatch.delenv("MOE_RL_DEBUG", raising=False)
    te = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    assert not _shown(te, UserWarning, "megatron.core.optimizer")
    assert _shown(te, UserWarning, "moe_rl.learner.build")  # another module's: not megatron's fallback
    assert _shown(te, DeprecationWarning, "megatron.core.optimizer")  # another category
    gather = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ..."
    c10d = "torch.distributed.c10d_logger"
    assert not _shown(gather, FutureWarning, c10d)
    assert _shown("`torch.distributed.broadcast` is deprecated", FutureWarning, c10d)
    assert _shown("some other megatron warning", UserWarning, "megatron.core.optimizer.optimizer")
    monkeypatch.setenv("MOE_RL_DEBUG", "1")  # --debug shows everything
    assert _shown(te, UserWarning, "megatron.core.optimizer")


@pytest.mark.unit
def test_log_records_are_dropped_by_exact_text(monkeypatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.delenv("MOE_RL_DEBUG", raising=False)
    silence_known_noise()
    log = logging.getLogger("megatron.core.rerun_state_machine")
    with caplog.at_level(logging.WARNING, logger=log.name):
        log.warning("RerunStateMachine initialized in mode %s", "RerunMode.DISABLED")
        log.warning("Implicit initialization of Rerun State Machine!")
        log.warning("RerunStateMachine initialized in mode %s", "RerunMode.VALIDATE_RESULTS")
    assert [r.getMessage() for r in caplog.records] == [
        "RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS"
    ]


@pytest.mark.unit
def test_vllm_records_are_dropped_by_logger_template_and_arguments(
    monkeypatch, caplog: pytest.LogCaptureFixture
):
    """vLLM's known warnings go by logger and template; "not loaded" only when every name is a
    routed-experts weight (vLLM's naming slip), "Failed to load weights" only for a rotary
    embedding; INFO goes by vLLM's own level, set unless the user set one, and not under --debug."""
    monkeypatch.delenv("MOE_RL_DEBUG", raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("WANDB_DISABLE_WEAVE", raising=False)
    silence_known_noise()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING" and os.environ["WANDB_DISABLE_WEAVE"] == "true"
    runner = logging.getLogger("vllm.v1.worker.gpu_model_runner")
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    worker = logging.getLogger("vllm.v1.worker.cpu_worker")
    experts = {
        f"model.layers.{i}.mlp.experts.routed_experts.{w}_weight" for i in (0, 1) for w in ("w13", "w2")
    }
    not_loaded = "Following weights were not loaded from checkpoint: %s"
    with caplog.at_level(logging.WARNING):
        runner.warning(not_loaded, experts)
        runner.warning(not_loaded, experts | {"model.layers.0.self_attn.qkv_proj.weight"})
        runner.warning(not_loaded, set())
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")
        worker.warning("%s is not found in LD_PRELOAD. For best performance, please follow ...", "libiomp")
        worker.warning("Node %s is not in available memory nodes %s.", 1, [0])
    assert [r.getMessage() for r in caplog.records] == [
        not_loaded % (experts | {"model.layers.0.self_attn.qkv_proj.weight"},),
        not_loaded % (set(),),
        "QKVParallelLinear: Failed to load weights",
        "Node 1 is not in available memory nodes [0].",
    ]
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's own setting wins
    silence_known_noise()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    monkeypatch.setenv("MOE_RL_DEBUG", "1")
    silence_known_noise()
    assert "VLLM_LOGGING_LEVEL" not in os.environ
