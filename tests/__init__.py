"""The test package. Importing it installs what every rank of the product installs before
megatron is imported (moe_rl/lazy_imports.py): the pytest process and the ranks that
tests/dist_harness.py spawns (they import this package to unpickle their function) run megatron's
fused functions as a CPU rank of ``moe-rl train`` does."""

from moe_rl.lazy_imports import defer_megatron_compile

defer_megatron_compile()
