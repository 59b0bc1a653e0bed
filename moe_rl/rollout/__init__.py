"""Rollout engines: the interface (base.py), the built-in CPU engine (builtin.py, builtin_model.py),
the vLLM engine (the vllm/ package) and its pure config rules (vllm_rules.py, which the config loader
imports)."""
