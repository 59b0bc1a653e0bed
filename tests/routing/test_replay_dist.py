"""dist tier: routing replay in the megatron learner, EP=2 over gloo on 2 ranks.

One spawn runs every check (the import costs ~10 s): forced indices are honoured and the last
row routes natively, pad rows get the spread pad routes, router-weight gradients under replay are
non-zero and equal to Hugging Face's Qwen3-MoE with the same routes forced, micro-batching and
activation recomputation give the same result, R2 record -> replay reproduces the native pass
exactly, and a stale or unconsumed batch fails closed."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig
from tests.dist_harness import run_ranks
from tests.models import TINY_MOE_L3 as MODEL

GRAD_RTOL = 1e-4
S = 10


def _data(rank: int):
    g = torch.Generator().manual_seed(200 + rank)
    lens_B = torch.tensor([10, 6, 8, 4]) if rank == 0 else torch.tensor([7, 10, 5, 9])
    pos_S = torch.arange(S)
    tokens_BS = torch.where(
        pos_S[None] < lens_B[:, None], torch.randint(3, MODEL.vocab_size, (4, S), generator=g), 0
    )
    mask_BS = (pos_S[None] >= 2) & (pos_S[None] < lens_B[:, None])
    return tokens_BS, lens_B, mask_BS


def _routes(rank: int, lens_B: torch.Tensor, header):
    from moe_rl.routing.record import RouteBatch

    g = torch.Generator().manual_seed(300 + rank)
    rows_B = lens_B - 1
    n = int(rows_B.sum())
    ids_NLK = torch.rand(n, len(header.layer_ids), MODEL.num_experts, generator=g).argsort(-1)[..., :2]
    return RouteBatch(
        ids_NLK.to(torch.uint8), rows_B, torch.zeros(4, dtype=torch.int64), torch.full((4,), 2), header
    )


def _nll(mb, st, normalizer):
    return -(st.logp_BS * mb.loss_mask_BS).sum() / normalizer, {}


def _update_flips(learner, mb, plan) -> dict[str, float]:
    """The update pass's ``router_grad/update_flip*`` metrics (vs the old pass's routes) of one
    forward-backward of ``mb``."""
    _, routing = learner.forward_backward(mb, _nll, 1.0, 2, plan)
    return {
        k: float(v.sum / v.count)
        for k, v in routing.metrics.items()
        if k.startswith("router_grad/update_flip")
    }


def _capture(learner):
    """Forward hooks recording each router's input and routing map, per call."""
    seen: dict[int, list] = {}
    handles = []
    for layer in learner.gpt.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is None:
            continue
        lid = layer.layer_number - 1

        def hook(mod, inp, out, lid=lid):
            seen.setdefault(lid, []).append((inp[0].detach().reshape(-1, inp[0].shape[-1]), out[1].detach()))

        handles.append(router.register_forward_hook(hook))
    return seen, handles


def _hf_router_grads(weights, routes_by_rank, data_by_rank, header):
    """HF Qwen3-MoE with the same routes forced (last rows native), same summed NLL: router grads."""
    import transformers

    from tests.hf_reference import canonical_to_hf_memory, hf_config

    model = transformers.Qwen3MoeForCausalLM(hf_config(MODEL))
    model.load_state_dict(canonical_to_hf_memory(weights, MODEL), strict=True)
    total_tokens = sum(int(m.sum()) for _, _, m in data_by_rank)
    loss = 0.0
    for (tokens_BS, lens_B, mask_BS), routes in zip(data_by_rank, routes_by_rank):
        forced_BSLK = torch.full((4, S, len(header.layer_ids), 2), -1, dtype=torch.int64)
        forced_BSLK[routes.sample_N, routes.position_N] = routes.ids_NLK.long()

        def make_gate(gate, forced_NK):
            def forward(hidden):
                logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
                native = torch.topk(logits, 2, dim=-1).indices
                idx = torch.where(forced_NK >= 0, forced_NK, native)
                return logits, torch.softmax(logits.gather(1, idx), -1), idx

            return forward

        for pos, lid in enumerate(header.layer_ids):
            gate = model.model.layers[lid].mlp.gate
            gate.forward = make_gate(gate, forced_BSLK[:, :, pos].reshape(-1, 2))
        logits = model(input_ids=tokens_BS, attention_mask=(tokens_BS != 0).long()).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens_BS[:, 1:, None]).squeeze(-1)
        loss = loss - (logp * mask_BS[:, 1:]).sum() / total_tokens
    loss.backward()
    return {lid: model.model.layers[lid].mlp.gate.weight.grad.clone() for lid in header.layer_ids}


def _worker(rank: int):
    from megatron.core import parallel_state as ps  # noqa: F401

    from moe_rl import dist
    from moe_rl.learner.learner import Learner
    from moe_rl.routing.replay import ReplayError
    from moe_rl.routing.replay_plan import PassMode, PassPlan
    from moe_rl.routing.row_layout import pad_routes
    from moe_rl.types import TrainBatch
    from moe_rl.weights.canonical import random_canonical_weights

    replay, observe, record = PassPlan(PassMode.REPLAY), PassPlan(PassMode.OBSERVE), PassPlan(PassMode.RECORD)

    weights = random_canonical_weights(MODEL, seed=1)
    par = ParallelConfig(nproc=2, expert_parallel=2, distributed_optimizer=False)
    ctx = dist.init_distributed(par, seed=7)
    learner = Learner(MODEL, par, OptimConfig(lr=1e-2), ctx, weights)
    header = learner.route_header
    tokens_BS, lens_B, mask_BS = _data(rank)
    routes = _routes(rank, lens_B, header)
    out: dict = {}

    # (1) forced indices honoured, last row native, pads spread
    seen, handles = _capture(learner)
    plain = TrainBatch(tokens_BS, lens_B)
    with_routes = plain.replace(routes=routes)
    out_replay = learner.forward_logprobs(with_routes, 1.0, 4, replay)
    logp_replay = out_replay.stats.logp_BS
    for h in handles:
        h.remove()
    B = 4
    forced_ok, last_native_ok, pad_ok = True, True, True
    for pos, lid in enumerate(header.layer_ids):
        x_NH, map_NE = seen[lid][0]
        chosen_NK = map_NE.nonzero()[:, 1].view(-1, 2)
        flat = routes.position_N * B + routes.sample_N
        forced_ok &= bool(
            (chosen_NK[flat].sort(-1).values == routes.ids_NLK[:, pos].long().sort(-1).values).all()
        )
        router_w = learner.gpt.decoder.layers[lid].mlp.router.weight
        native_NK = torch.topk(x_NH.float() @ router_w.float().t(), 2, dim=-1).indices
        last = (lens_B - 1) * B + torch.arange(B)
        last_native_ok &= bool((chosen_NK[last].sort(-1).values == native_NK[last].sort(-1).values).all())
        pad_N = (torch.arange(S)[:, None] >= lens_B[None, :]).reshape(-1)
        pad_ok &= bool(
            (chosen_NK[pad_N].sort(-1).values == pad_routes(int(pad_N.sum()), 2, 4, 2).sort(-1).values).all()
        )
    out.update(forced_ok=forced_ok, last_native_ok=last_native_ok, pad_ok=pad_ok)
    out["flip_metrics"] = {
        k: float(v.sum / v.count)
        for k, v in out_replay.routing.metrics.items()
        if k in ("routing/flip_router_frac", "routing/missing_frac")
    }

    # (1b) router-gradient monitor: with softmax over the top-k logits and no aux loss only the
    # K selected logits of a token get gradient: exactly (E - K) / E of the entries get none
    learner.forward_backward(plain.replace(loss_mask_BS=mask_BS), _nll, 1.0, 2)
    router = learner.router_monitor_metrics()
    out["monitor"] = {k: v for k, v in router.items() if "/layer" not in k}
    out["monitor_layer"] = {k: v for k, v in router.items() if k.endswith("/layer1")}

    # (1c) update-induced flips, replay off: an update forward with the old pass's weights is the
    # same forward (determinism check, docs/math.md 7.2 item 5): exactly 0 on CPU
    old_routes = learner.forward_logprobs(
        plain, 1.0, 2, PassPlan(PassMode.OBSERVE, keep_native=True)
    ).routing.recorded
    mb_old = plain.replace(loss_mask_BS=mask_BS, old_routes=old_routes)
    out["update_flip_same"] = _update_flips(learner, mb_old, observe)
    learner.router_monitor_metrics()

    # (2) micro-batching: 2 micro-batches of 2 give the same log-probs as 1 of 4
    logp_mb2 = learner.forward_logprobs(with_routes, 1.0, 2, replay).stats.logp_BS
    real_BS = (torch.arange(S)[None] >= 1) & (torch.arange(S)[None] < lens_B[:, None])  # pads are garbage
    out["mb_diff"] = float((logp_mb2 - logp_replay)[real_BS].abs().max())

    # (3) router grads under replay == HF reference with the same routes forced
    batch = with_routes.replace(loss_mask_BS=mask_BS)
    learner.forward_backward(batch, _nll, 1.0, 2, replay)
    grads = learner.canonical_grads()
    data_by_rank = [_data(r) for r in range(2)]
    hf = _hf_router_grads(
        weights, [_routes(r, data_by_rank[r][1], header) for r in range(2)], data_by_rank, header
    )
    out["router_grad_min_norm"] = min(
        float(grads[f"model.layers.{lid}.mlp.gate.weight"].norm()) for lid in hf
    )
    out["router_grad_rel"] = max(
        float((grads[f"model.layers.{lid}.mlp.gate.weight"] - g).abs().max() / g.abs().max())
        for lid, g in hf.items()
    )

    # (4) R2: record natively, replay the record -> the native pass, bitwise
    native = learner.forward_logprobs(plain, 1.0, 4, record)
    logp_native, recorded = native.stats.logp_BS, native.routing.recorded
    out["recorded_rows"] = recorded.rows_B.tolist()
    r2 = learner.forward_logprobs(plain.replace(routes=recorded), 1.0, 2, replay)
    out["r2_equal"] = bool(torch.equal(r2.stats.logp_BS[real_BS], logp_native[real_BS]))
    out["r2_flip"] = float(
        sum(v.sum for k, v in r2.routing.metrics.items() if k == "routing/flip_router_frac")
    )

    # (5) fail closed: a stale batch, and routes that were never consumed
    with pytest.raises(ReplayError, match="forward without routes"):
        with learner.replay.run(replay, with_backward=False), learner.replay.micro_batch(with_routes, S):
            learner.gpt.eval()
            pos = torch.arange(S).expand(4, S)
            with torch.no_grad():
                learner.gpt(tokens_BS, pos, None)
                learner.gpt(tokens_BS, pos, None)  # same routes again: stale
    with pytest.raises(ReplayError, match=r"layer 1: consumed 0 of 1 micro-batches' routes"):
        with learner.replay.run(replay, with_backward=False), learner.replay.micro_batch(with_routes, S):
            pass  # no forward: the routes stay unconsumed
    out["fail_closed"] = True

    # (6) activation recomputation: same grads, every queued route served again
    import dataclasses

    rec = Learner(dataclasses.replace(MODEL, recompute=True), par, OptimConfig(lr=1e-2), ctx, weights)
    rec.forward_backward(batch, _nll, 1.0, 2, replay)
    g_rec = rec.canonical_grads()
    out["recompute_grad_diff"] = max(float((g_rec[k] - grads[k]).abs().max()) for k in grads)
    out["recompute_served"] = list(zip(rec.replay.server.served_forward, rec.replay.server.served_backward))

    # (1d) after an optimizer step (Adam, lr 1e-2 on 0.02-scale weights) the update forward's
    # expert sets move away from the old pass's: the same metric is then positive
    learner.update(mb_old, _nll, 1.0, 2, lr=1e-2, plan=observe)
    out["update_flip_after_step"] = _update_flips(learner, mb_old, observe)
    dist.shutdown()
    return out


@pytest.mark.dist
def test_replay_in_megatron():
    for rank, r in enumerate(run_ranks(_worker, 2)):
        assert r["forced_ok"] and r["last_native_ok"] and r["pad_ok"], (rank, r)
        assert 0.0 < r["flip_metrics"]["routing/flip_router_frac"] <= 1.0, r  # random routes disagree
        assert r["flip_metrics"]["routing/missing_frac"] == 0.0
        assert r["mb_diff"] < 1e-5, r  # same routes, different micro-batch shapes: reduction order only
        assert r["router_grad_min_norm"] > 0, r
        assert r["router_grad_rel"] < GRAD_RTOL, (rank, r)
        assert r["recorded_rows"] == (_data(rank)[1] - 1).tolist()
        assert r["r2_equal"] and r["r2_flip"] == 0.0, r
        assert r["fail_closed"]
        assert r["monitor"]["router_grad/zero_frac"] == 0.5 and r["monitor"]["router_grad/norm"] > 0, r
        layer = r["monitor_layer"]
        assert (
            layer["router_grad/zero_frac/layer1"] == 0.5 and 0 < layer["router_grad/load_entropy/layer1"] <= 1
        )
        assert (
            layer["router_grad/margin_mean/layer1"] > 0
            and 0 <= layer["router_grad/near_boundary_frac/layer1"] <= 1
        )
        assert (
            0
            < layer["router_grad/margin_p1/layer1"]
            <= layer["router_grad/margin_p5/layer1"]
            <= layer["router_grad/margin_p50/layer1"]
        ), layer
        assert (
            layer["router_grad/logit_grad_norm_max/layer1"]
            >= layer["router_grad/logit_grad_norm_mean/layer1"]
            > 0
        )
        assert r["monitor"]["router_grad/zero_frac_expected"] == 0.5
        same, moved = r["update_flip_same"], r["update_flip_after_step"]
        assert set(same) == {
            "router_grad/update_flip_frac",
            "router_grad/update_flip_frac/layer1",
            "router_grad/update_flip_frac/layer2",
            "router_grad/update_flip_token_frac",
            "router_grad/update_flip_layers_per_token",
        }, same
        assert all(v == 0.0 for v in same.values()), same
        assert (
            0 < moved["router_grad/update_flip_frac"] <= moved["router_grad/update_flip_token_frac"] <= 1
        ), moved
        assert r["recompute_grad_diff"] < 1e-6, r
        assert r["recompute_served"] == [(2, 2), (2, 2)], r
