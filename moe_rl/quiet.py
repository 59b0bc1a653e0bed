"""Messages of megatron-core and torch that tell a user of moe-rl nothing to act on, silenced by
exact message, category and module (never a blanket ignore), each with the reason it is noise.

``silence_known_noise`` runs at the start of every process of a job: the CLI (the launcher) and
each rank (``moe_rl.launch.run_worker``; spawned ranks are fresh interpreters, which inherit no
warning filter). What stays: every other warning, and these same ones under ``--debug`` /
``MOE_RL_DEBUG=1``. wandb's own lines are handled where it starts (``moe_rl.metrics``); the
checkpoint-time "common state dict differs" warning and megatron's "full scope is deprecated"
are fixed at their cause (``moe_rl.learner.checkpoint``, ``moe_rl.learner.build``). Imports
nothing from the package.
"""

from __future__ import annotations

import logging
import os
import warnings

# (message regex, category, module regex) of ``warnings.warn`` calls; the regexes match from the
# start (``warnings.filterwarnings``), the module is the one that calls ``warn``
WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # a CPU (or TE-less) install runs megatron's torch fallbacks by design; a config that needs
    # Transformer Engine is refused at launch (moe_rl/preflight.py), and `moe-rl env` lists what
    # is installed. Printed once per module that imports them, per rank.
    (r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning, r"megatron\."),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.core\."),
    # torch deprecates the collectives megatron-core calls (all_gather_into_tensor,
    # reduce_scatter_tensor): megatron's to change; the wrapper that warns is torch's c10d logger
    (
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        FutureWarning,
        r"torch\.distributed\.c10d_logger",
    ),
    # a resume's checkpoint load: megatron-core's torch strategy calls torch's deprecated
    # ``load_state_dict``, and torch's planner reads attributes of megatron's ShardedTensors,
    # whose deprecation torch announces at each read; megatron's to move to the new APIs
    (
        r"`load_state_dict` is deprecated and will be removed in future versions\. Please use `load`",
        FutureWarning,
        r"megatron\.core\.dist_checkpointing\.strategies\.torch",
    ),
    (
        r"Please use DTensor instead and we are deprecating ShardedTensor\.",
        FutureWarning,
        r"torch\.distributed\.checkpoint\.",
    ),
    # the DistributedOptimizer's fp32 shards are views of the model params (not leaf tensors);
    # megatron's zero_grad reads their .grad, which is never set (their gradients are main_grad)
    (
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        UserWarning,
        r"megatron\.core\.optimizer\.optimizer",
    ),
)

# logger name -> exact messages of ``logging`` records to drop
LOG_RECORDS: dict[str, frozenset[str]] = {
    # megatron's rerun state machine (re-running a step on a NaN or spiky loss) is off in moe-rl;
    # megatron logs its creation at WARNING whatever the mode, and "implicit" because the
    # learner never asks for it
    "megatron.core.rerun_state_machine": frozenset(
        {
            "Implicit initialization of Rerun State Machine!",
            "RerunStateMachine initialized in mode RerunMode.DISABLED",
        }
    ),
}


class _DropExact(logging.Filter):
    def __init__(self, messages: frozenset[str]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.messages


def silence_known_noise() -> None:
    """Install the filters of ``WARNINGS`` and ``LOG_RECORDS`` in this process (idempotent);
    nothing under ``MOE_RL_DEBUG``."""
    if os.environ.get("MOE_RL_DEBUG", "") not in ("", "0"):
        return
    for message, category, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, messages in LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExact) for f in logger.filters):
            logger.addFilter(_DropExact(messages))
