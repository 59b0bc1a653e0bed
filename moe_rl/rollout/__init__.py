"""Rollout engines: the interface (base.py), the built-in CPU engine (builtin.py, builtin_model.py)."""
