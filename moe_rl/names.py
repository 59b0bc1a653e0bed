"""The names a config is validated against, one tuple per registry family (no torch import, so
``moe_rl.config`` can load without the math). Each registry's keys equal its tuple here
(tests/test_config_keys.py ``test_registries_hold_the_names_configs_accept``); nothing else spells
these lists."""

from __future__ import annotations

ADVANTAGE_NAMES = ("grpo", "rloo", "otb", "otb_multiturn")  # moe_rl.maths.advantages.ADVANTAGES
# every advantage above is a per-group baseline: each needs >= 2 samples per prompt
GROUP_ADVANTAGE_NAMES = ADVANTAGE_NAMES
IS_LEVEL_NAMES = ("token", "sequence", "geometric")  # moe_rl.corrections.importance.IS_LEVELS ("none": off)
RS_AGGREGATION_NAMES = (
    "token",
    "seq_sum",
    "seq_mean",
    "seq_max",
)  # moe_rl.corrections.importance.RS_AGGREGATIONS
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")  # the per-token KL estimators (rejection kinds, algo.kl_estimator)
SAFE_SET_RULE_NAMES = ("relative", "top_p")  # moe_rl.corrections.dvp.SAFE_SET_RULES
# moe_rl.config.hf_model.FAMILIES (Kimi-K2's kimi_k2 config.json is read as deepseek_v3)
HF_FAMILY_NAMES = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "qwen2_moe")
# Trust Region Masking (moe_rl.corrections.trm): what pi_train is, where the KL comes from, the
# length-neutral criteria ("none": off)
TRM_REFERENCE_NAMES = ("theta", "old")
TRM_KL_SOURCE_NAMES = (
    "exact",
    "sample",
)  # exact: full rollout distributions (built-in engine); sample: k2/k3
LENGTH_NEUTRAL_NAMES = ("none", "ln", "ser")
BYPASS_LOSS_NAMES = (
    "ppo_clip",
    "reinforce",
)  # moe_rl.corrections.corrected_loss.BYPASS_MODES (correction.bypass_loss)
