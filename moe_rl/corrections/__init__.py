"""Rollout correction: importance weights and rejection (``importance``), Trust Region Masking
(``trm``), Dynamic Vocabulary Pruning (``dvp``), and post-reduction metrics (``derived``).

Pure tensor functions, tensors in and ``(tensor, metrics)`` out, no collectives (docs/design.md 11.1).
One direction convention: every ratio bound is on rho = pi_train / pi_rollout
(``importance`` module docstring). The losses that consume the weights and masks live in
``moe_rl.losses`` (``decoupled_ppo_loss``, ``bypass_loss``, ``BYPASS_MODES``), above this package;
the log-ratio and KL-estimator helpers both use live in ``moe_rl.ratios``, below both.

Names a config may use are checked when it loads against the tuples of ``moe_rl.names`` (pure:
config does not import torch); tests keep the registries here (``IS_LEVELS``, ``RS_AGGREGATIONS``,
``SAFE_SET_RULES``) equal to them, and ``LENGTH_NEUTRAL``, ``TRM_REFERENCES``, ``TRM_KL_SOURCES`` are
those tuples. The rejection-option grammar ``parse_rs_spec`` lives in ``moe_rl.rejection``
(re-exported here).
"""

from moe_rl.corrections.derived import derive_metrics
from moe_rl.corrections.dvp import (
    DEFAULT_RHO_MIN,
    SAFE_SET_RULES,
    RestrictedLogprobs,
    dvp_metrics,
    restricted_logprobs,
    safe_set,
)
from moe_rl.corrections.importance import (
    IS_LEVELS,
    RS_AGGREGATIONS,
    is_batch_mean_parts,
    is_weights,
    log_ratio,
    offpolicy_metrics,
    parse_rs_spec,
    rejection_mask,
)
from moe_rl.corrections.trm import (
    ACCEPT_ALARM_BELOW,
    LENGTH_NEUTRAL,
    TRM_REFERENCES,
    exact_kl_tokens,
    sample_kl_tokens,
    trm_bounds,
    trm_mask,
)
from moe_rl.names import TRM_KL_SOURCE_NAMES

TRM_KL_SOURCES = TRM_KL_SOURCE_NAMES  # exact: full rollout distributions (built-in engine); sample: k2/k3

__all__ = [
    "ACCEPT_ALARM_BELOW",
    "DEFAULT_RHO_MIN",
    "IS_LEVELS",
    "LENGTH_NEUTRAL",
    "RS_AGGREGATIONS",
    "SAFE_SET_RULES",
    "TRM_KL_SOURCES",
    "TRM_REFERENCES",
    "RestrictedLogprobs",
    "derive_metrics",
    "dvp_metrics",
    "exact_kl_tokens",
    "is_batch_mean_parts",
    "is_weights",
    "log_ratio",
    "offpolicy_metrics",
    "parse_rs_spec",
    "rejection_mask",
    "restricted_logprobs",
    "safe_set",
    "sample_kl_tokens",
    "trm_bounds",
    "trm_mask",
]
