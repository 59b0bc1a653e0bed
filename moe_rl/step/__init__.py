"""One RL step, from scored rollouts to the logged metrics, run from a ``StepPlan`` built once
from the config (``plan``): ``prepare`` (old-log-prob pass, corrections, advantages, reference
pass), ``update`` (learning rate, optimizer steps), ``finalize`` (reduction, derived metrics);
``correction`` is the rollout correction as a plan runs it; ``validation`` is the validation pass
(an engine pass over the validation prompts, every ``log.val_every`` steps).

This package's __init__ imports nothing: importing one stage does not import the others."""
