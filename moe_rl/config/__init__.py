"""The typed config tree and its loader: the single source of truth for every run.

Dataclasses define fields, defaults and validation. YAML files (``configs/*.yaml``) and dotted
command-line overrides (``rollout.temperature=0.8``) only override them. Loading goes through
OmegaConf's structured configs, so an unknown key or a wrong type fails before any work starts,
naming the full dotted key; cross-field checks in ``__post_init__`` name the keys too. Renamed keys
keep working for one release through one table (``DEPRECATED_KEYS``), with a one-line warning.
Megatron's own argument names appear only in ``moe_rl/learner/build.py``.

The package, one job per module; everything public is re-exported here, so callers import from
``moe_rl.config``:
- ``model``: ``ModelConfig``, ``ParallelConfig``, ``ARCH_FIELDS``;
- ``run``: the other subtrees (optim, rollout, routing, task, algo, log) and the root ``RunConfig``;
  ``correction`` is ``CorrectionSpec`` (with ``TrmSpec``, ``RejectionSpec``), owned next to its maths
  in ``moe_rl.corrections.correction_specs`` and re-exported here;
- ``schedule``: ``Schedule`` (colocated sync, split sync, one_step_off, async), built once from the
  tree; the one place ``rollout.mode`` is compared;
- ``deprecations``: ``DEPRECATED_KEYS`` and the legacy-key renames;
- ``loader``: ``load_config``, ``load_run_config`` (resume's base: the run's saved config),
  ``to_dict``, ``to_yaml``;
- the pure rules the tree validates with: ``layout`` (the layout arithmetic), ``vllm_rules`` (what
  the vLLM engine cannot give the learner), ``hf_model`` (an HF config.json -> the ``model:``
  section) on ``hf_json`` (config.json read by type).

Near the bottom of the package: imports only pure modules (no torch, no megatron;
tests/test_style.py): the checks (``moe_rl.checks``), the names configs validate against
(``moe_rl.names``) and the feature specs (``moe_rl.corrections.correction_specs``,
``moe_rl.maths.policy_specs``, ``moe_rl.maths.lr_specs``).
What depends on the machine (CUDA, Transformer Engine, vllm installed) is checked when a run
starts, in ``moe_rl/preflight.py``.
"""

from moe_rl.config.agent import AgentConfig
from moe_rl.config.deprecations import DEPRECATED_KEYS
from moe_rl.config.loader import SAVED_CONFIG, load_config, load_run_config, to_dict, to_yaml
from moe_rl.config.model import ARCH_FIELDS, ModelConfig, ParallelConfig
from moe_rl.config.run import (
    AlgoConfig,
    HealthConfig,
    LogConfig,
    OptimConfig,
    RolloutConfig,
    RoutingConfig,
    RunConfig,
    TaskConfig,
    VllmConfig,
)
from moe_rl.config.schedule import Schedule, ScheduleKind
from moe_rl.corrections.correction_specs import CorrectionSpec, RejectionSpec, TrmSpec
from moe_rl.errors import ConfigError
from moe_rl.maths.lr_specs import LengthLRConfig

__all__ = [
    "AgentConfig",
    "ARCH_FIELDS",
    "DEPRECATED_KEYS",
    "AlgoConfig",
    "ConfigError",
    "CorrectionSpec",
    "HealthConfig",
    "LengthLRConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RejectionSpec",
    "RolloutConfig",
    "RoutingConfig",
    "RunConfig",
    "Schedule",
    "ScheduleKind",
    "TaskConfig",
    "TrmSpec",
    "VllmConfig",
    "SAVED_CONFIG",
    "load_config",
    "load_run_config",
    "to_dict",
    "to_yaml",
]
