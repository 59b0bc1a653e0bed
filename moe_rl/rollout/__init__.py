"""Rollout engines: the interface (base.py), the built-in CPU engine (builtin.py, builtin_model.py),
the vLLM engine (the vllm/ package; its pure config rules are moe_rl/config/vllm_rules.py)."""
