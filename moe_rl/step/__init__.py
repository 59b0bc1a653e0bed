"""One RL step, from scored rollouts to the logged metrics, run from a ``StepPlan`` built once
from the config (``plan``): ``prepare`` (old-log-prob pass, corrections, advantages, reference
pass), ``update`` (learning rate, optimizer steps), ``finalize`` (reduction, derived metrics);
``correction`` is the rollout correction as a plan runs it.

This package's __init__ imports nothing: importing one stage does not import the others."""
