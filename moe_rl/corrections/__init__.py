"""Rollout correction: the torch-free specs of every correction (``specs``: IS, rejection with its
grammar, TRM, DVP, and the correction as a whole), and their maths: importance weights and
rejection (``importance``), Trust Region Masking (``trm``), Dynamic Vocabulary Pruning (``dvp``),
post-reduction metrics (``derived``) and the masked reductions they share (``masked``).

The maths is pure tensor functions, tensors and specs in and ``(tensor, metrics)`` out, no
collectives (docs/design.md 11.1). One direction convention: every ratio bound is on
rho = pi_train / pi_rollout (``importance`` module docstring). The pure surrogates live in
``moe_rl.maths.losses``, below this package; the losses that apply corrections inside the loss
(bypass, ``PolicyLoss``) in ``corrected_loss`` here; the log-ratio and KL-estimator helpers both
use live in ``moe_rl.maths.ratios``. maths/ never imports this package (issue 41).

This ``__init__`` imports nothing, so ``moe_rl.config`` composes ``specs`` without torch; callers
import the module they use. Names a config may use are the tuples of ``moe_rl.names``; tests keep
the registries (``importance.IS_LEVELS``, ``importance.RS_AGGREGATIONS``, ``dvp.SAFE_SET_RULES``)
equal to them.
"""
