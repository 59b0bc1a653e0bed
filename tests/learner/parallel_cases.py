"""What the TP and PP learner tests share: tolerances, forced random routes, the loss, metric means.

Tolerances (fp32): log-probs / entropy / sum pi^2 max |diff| < LOGP_TOL; gradients max relative
diff < GRAD_RTOL per tensor; weights after one Adam step (lr LR) max |diff| < STEP_TOL."""

from __future__ import annotations

import torch

from moe_rl.metrics import Mean
from moe_rl.routing.plan import PassMode, PassPlan

LOGP_TOL = 1e-5
GRAD_RTOL = 1e-5
STEP_TOL = 1e-6
LR = 1e-3


def random_routes(lens_B: torch.Tensor, header):
    """Distinct random experts for every recorded row (prompts of 2 tokens), seeded."""
    from moe_rl.routing.record import RouteBatch

    g = torch.Generator().manual_seed(300)
    rows_B = lens_B - 1
    ids_NLK = torch.rand(int(rows_B.sum()), len(header.layer_ids), header.num_experts,
                         generator=g).argsort(-1)[..., :header.top_k]
    B = lens_B.shape[0]
    return RouteBatch(ids_NLK.to(torch.uint8), rows_B, torch.zeros(B, dtype=torch.int64), torch.full((B,), 2), header)


def nll_entropy_loss(mb, st, normalizer):
    """NLL with an entropy bonus, so the entropy's (vocab-parallel) gradient is checked too."""
    m, logp_BS, entropy_BS = mb.loss_mask_BS, st.logp_BS, st.entropy_BS
    loss = (-(logp_BS * m).sum() - 0.1 * (entropy_BS * m).sum()) / normalizer
    return loss, {"train/nll": Mean(-(logp_BS * m).sum().detach(), m.sum())}


REPLAY, RECORD = PassPlan(PassMode.REPLAY), PassPlan(PassMode.RECORD)


def reference_dims():
    """The dimensions of a single-rank-model reference after megatron's parallel state was rebuilt."""
    from moe_rl.dist import ParallelDims

    return ParallelDims.from_parallel_state()


def means(metrics: dict, prefix: str) -> dict[str, float]:
    return {k: float(v.sum / v.count) for k, v in metrics.items() if k.startswith(prefix)}
