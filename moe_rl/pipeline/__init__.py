"""The step's timeline (issue 41; docs/design.md 16): where each role runs and how rollouts,
updates, weight syncs and offloads follow one another, for the ``Schedule`` the config chose
(``moe_rl/config/schedule.py``: colocated sync, split sync, one_step_off, async).

- ``placement``: the roles' ranks and the process groups that link them (started by
  ``moe_rl.dist.init_distributed``, so it sits on a lower layer than the rest of the package);
- ``engines``: the engine a learner rank talks to (its own, or the ``RemoteEngine``);
- ``remote_engine``: the learner side of a split world, standing in for the rollout ranks' engines;
- ``rollout_ranks``: the rollout ranks' loop;
- ``request_buffer``: the async request buffer and its staleness filter;
- ``weight_sync``: the one owner of the learner -> engine sync (``WeightSync``, and the rollout
  ranks' receive side); ``weight_broadcast``: its wire format between roles;
- ``offload_timeline``: the one owner of what is on the device at each phase;
- ``simulated_staleness``: ``rollout.staleness=k``, a colocated engine k updates behind.

This ``__init__`` imports nothing: callers import the module they use.
"""
