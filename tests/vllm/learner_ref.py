"""The megatron learner's side of the vllm tier, run in one spawned CPU rank (tests/dist_harness.py):
vLLM's routes forced (R3) with every router's chosen ids captured, log-probs at given temperatures,
then one update and the new weights as the learner's canonical layer stream. No vllm import here."""

from __future__ import annotations

import torch

from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig


def _capture(learner) -> tuple[dict[int, list[torch.Tensor]], list]:
    """Forward hooks keeping each router's chosen expert ids [N, K] per call, by layer number."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for layer in learner.gpt.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        lid = layer.layer_number - 1

        def hook(mod, inp, out, lid=lid):
            map_NE = out[1].detach()
            seen.setdefault(lid, []).append(map_NE.nonzero()[:, 1].view(map_NE.shape[0], -1))

        handles.append(router.register_forward_hook(hook))
    return seen, handles


def _nll(mb, st, normalizer):
    return -(st.logp_BS * mb.loss_mask_BS).sum() / normalizer, {}


def learner_side(rank: int, model: ModelConfig, weights, tokens_BS, lens_B, mask_BS, routes, temps, out_path):
    """``out_path``, where a dict is saved (torch.save): forced_NLK (the ids each MoE layer's
    router used for the recorded rows, [N, L, K] in the routes' row order), the replay pass's
    routing metrics, logp_T[T] (replayed), logp_old (native, T=1), chunks (the canonical stream
    after one update) and logp_new (native, T=1)."""
    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.routing.replay_plan import PassMode, PassPlan
    from moe_rl.types import TrainBatch

    par = ParallelConfig(nproc=1, expert_parallel=1, distributed_optimizer=False)
    learner = Learner(model, par, OptimConfig(lr=3e-2), dist.init_distributed(par, seed=7), weights)
    B = tokens_BS.shape[0]
    plain = TrainBatch(tokens_BS, lens_B)
    seen, handles = _capture(learner)
    replayed = learner.forward_logprobs(plain.replace(routes=routes), 1.0, B, PassPlan(PassMode.REPLAY))
    for h in handles:
        h.remove()
    flat_N = routes.position_N * B + routes.sample_N  # megatron's rows are [S, B] flattened
    layers = sorted(seen)
    out = {
        "forced_NLK": torch.stack([seen[lid][0][flat_N] for lid in layers], 1),
        "layers": layers,
        "metrics": {k: float(v.sum / v.count) for k, v in replayed.routing.metrics.items()},
        "logp_T": {1.0: replayed.stats.logp_BS},
    }
    for T in temps:
        if T != 1.0:
            p = learner.forward_logprobs(plain.replace(routes=routes), T, B, PassPlan(PassMode.REPLAY))
            out["logp_T"][T] = p.stats.logp_BS
    out["logp_old"] = learner.forward_logprobs(plain, 1.0, B).stats.logp_BS
    learner.update(plain.replace(loss_mask_BS=mask_BS), _nll, 1.0, B, lr=3e-2)
    out["chunks"] = [{k: v.clone() for k, v in c.items()} for c in learner.iter_canonical_layers()]
    out["logp_new"] = learner.forward_logprobs(plain, 1.0, B).stats.logp_BS
    # to a file: run_ranks reads its queue after the ranks exit, so a tensor (shared by file
    # descriptor) could no longer be opened, and megabytes would block the pipe before the exit
    torch.save(out, out_path)
    return out_path
