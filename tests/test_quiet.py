"""moe_rl/quiet.py silences exactly the listed messages: by message, category and module for
warnings, by exact text and logger for log records; anything else still prints."""

from __future__ import annotations

import logging
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
