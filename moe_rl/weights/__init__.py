"""Canonical weights and every format they travel in (issue 23).

Canonical names are the Hugging Face Qwen3-MoE hub names with every expert present. Modules:
``canonical`` (names, shapes, strict checks), ``megatron_shards`` (canonical <-> megatron-core
shards on any EP/TP/PP layout), ``stream`` (the layer-by-layer stream of the weight sync),
``hf`` (HF checkpoint files; ``hf_config`` writes their config.json), ``warmstart`` (init weights of
a run). Exporting a run (``moe-rl export-hf``) is the entry point ``moe_rl/export.py``. Nothing is
re-exported here: import the module you need.
"""
