"""The end of a step's metrics: reduced over the data-parallel ranks, then the metrics that are
functions of reduced ones (variance proxies over the grad norm, derived correction metrics)."""

from __future__ import annotations

from moe_rl.corrections.derived import derive_metrics
from moe_rl.maths.variance import finalize_variance_proxies
from moe_rl.metrics import reduce_metrics


def finalize(local: dict, group=None) -> dict[str, float]:
    """Reduce this rank's metrics over ``group`` (tensor-parallel peers hold the same batch and
    the same metrics, so the data-parallel group) and add the post-reduction ones."""
    reduced = reduce_metrics(local, group=group)
    return derive_metrics(finalize_variance_proxies(reduced, reduced["train/grad_norm"]))
