"""Test tiers by marker (unit / dist / e2e / device / bad_input / gpu); gpu tests skip without CUDA.

wandb writes offline under a temporary directory so tests never touch HOME or the network."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

_WANDB_TMP = tempfile.mkdtemp(prefix="moe_rl_wandb_")
for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
    os.environ.setdefault(var, _WANDB_TMP)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


TIERS = ("unit", "dist", "e2e", "device", "gpu", "bad_input", "vllm", "slurm")


def pytest_configure(config):
    """The CPU tiers stay on the CPU on a GPU machine too: CUDA is hidden from every process they
    start (CLI runs, spawned ranks) unless the run selects the gpu tier (-m gpu)."""
    if "gpu" not in (config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    untiered = [item.nodeid for item in items if not any(t in item.keywords for t in TIERS)]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker {TIERS}: {untiered}")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
