"""Routing replay, measured side by side in one run on the tiny model (EP=2 over 2 local ranks).

    python scripts/bench_replay.py [--router-noise 0.05] [--prompts 64] [--reps 8]

Prints, for a rollout engine with a dialled-in mismatch (bf16 + Gaussian noise on its router
logits), the learner's old-log-prob pass with replay off vs R3:
  (a) flip rates of the routes the learner used vs the rollout's, at the three levels (router
      decision = (token, layer) pair, token = any layer, layers per token), rollout-vs-learner
      k3 KL and F(2) (fraction of tokens whose probability ratio exceeds 2 either way);
  (b) learner update step time with R3 / without: the median of the paired per-rep ratios over
      interleaved reps (off/r3, r3/off, ...) with its 95% interval (scripts/bench_stats.py), and
      the machine load during the run, so cost can be told from noise;
  (c) route bytes per token.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from bench_stats import MachineLoad, paired_ratios, ratio_line


def _measure(args) -> list[dict]:
    import torch

    import megatron_patches
    from moe_rl import dist
    from moe_rl.config import ParallelConfig, RunConfig
    from moe_rl.learner.learner import Learner
    from moe_rl.maths.losses import kl_estimate
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.routing.replay_plan import PassMode, PassPlan
    from moe_rl.step.plan import sampling_params
    from moe_rl.step.prepare import rollout_routes
    from moe_rl.tasks.task import build_prompt_source
    from moe_rl.tasks.task import resolve_vocab as resolve
    from moe_rl.tasks.tokenizer import CharTokenizer
    from moe_rl.types import TrainBatch
    from moe_rl.weights.warmstart import load_init_weights

    torch.set_num_threads(1)
    megatron_patches.apply_all()
    tok = CharTokenizer()
    cfg = resolve(RunConfig(), tok)
    ctx = dist.init_distributed(ParallelConfig(), seed=0)
    learner = Learner(
        cfg.model, cfg.parallel, cfg.optim, ctx, load_init_weights(cfg.init_weights, cfg.model, tok)
    )
    engine = BuiltinEngine(cfg.model, dtype="bf16", pad_id=tok.pad_id, router_logit_noise=args.router_noise)
    engine.load_weights(learner.export_canonical())
    t = cfg.task
    prompts = build_prompt_source(t.tasks, t.min_len, t.max_len, "", t.reward, tok).sample(
        args.prompts, seed=ctx.dp_rank
    )
    batch = engine.generate(
        [p.prompt_ids for p in prompts], 4, sampling_params(cfg, (tok.eos_id,)), seed=ctx.dp_rank
    )
    routes = rollout_routes(batch, learner.route_header)
    seq_lens_B = batch.prompt_lens_B + batch.response_lens_B
    m = batch.response_mask_BS
    res = {
        "bytes_per_token": routes.ids_NLK.element_size() * routes.ids_NLK.shape[1] * routes.ids_NLK.shape[2],
        "L_moe": routes.ids_NLK.shape[1],
        "K": routes.ids_NLK.shape[2],
        "E": cfg.model.num_experts,
    }
    tb = TrainBatch(batch.tokens_BS, seq_lens_B, loss_mask_BS=m, routes=routes)
    for name, mode in (("off", PassMode.OBSERVE), ("r3", PassMode.REPLAY)):
        out = learner.forward_logprobs(tb, 1.0, 64, PassPlan(mode))
        logp_BS = out.stats.logp_BS
        native = {k: v for k, v in out.routing.metrics.items() if "/layer" not in k}
        lr = (logp_BS - batch.logprobs_BS)[m]
        k3 = kl_estimate(batch.logprobs_BS, logp_BS, "k3")[m]
        res[name] = {
            "k3_sum": float(k3.sum()),
            "f2_sum": float((lr.abs() > math.log(2)).sum()),
            "n": int(m.sum()),
            "native": {k: [float(v.sum), float(v.count)] for k, v in native.items()},
        }

    def nll(mb, st, normalizer):
        return -(st.logp_BS * mb.loss_mask_BS).sum() / normalizer, {}

    # the agreement metrics' own cost (once per pass, after the schedule), timed directly
    collector, inside = learner.replay.collector, [0.0]
    finish = collector.finish

    def timed_finish():
        t0 = time.perf_counter()
        try:
            return finish()
        finally:
            inside[0] += time.perf_counter() - t0

    collector.finish = timed_finish
    times, metrics_s = {"off": [], "r3": []}, []
    for rep in range(args.reps + 1):
        for name in ("off", "r3") if rep % 2 == 0 else ("r3", "off"):
            mb = tb if name == "r3" else tb.replace(routes=None)
            torch.distributed.barrier()
            inside[0] = 0.0
            t0 = time.perf_counter()
            learner.update(mb, nll, 1.0, 64, 0.0, PassPlan(PassMode.REPLAY) if name == "r3" else None)
            torch.distributed.barrier()
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
                if name == "r3":
                    metrics_s.append(inside[0])
    res["step_s"], res["metrics_s"] = times, metrics_s
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, res)
    dist.shutdown()
    return gathered  # spawn_local hands every rank's return value back


def _per_rep_ratios(ranks: list[dict], num: str, den: str) -> list[float]:
    """One ratio per rep: the ranks' mean step times (barrier-synchronised, so nearly equal)."""

    def per_rep(name):
        return [statistics.fmean(ts) for ts in zip(*(r["step_s"][name] for r in ranks))]

    return paired_ratios(per_rep(num), per_rep(den))


def _report(ranks: list[dict], noise: float) -> None:
    def pooled(mode: str, key: str) -> float:
        s = sum(r[mode]["native"][key][0] for r in ranks if key in r[mode]["native"])
        c = sum(r[mode]["native"][key][1] for r in ranks if key in r[mode]["native"])
        return s / c if c else float("nan")

    r0 = ranks[0]
    n = sum(r["off"]["n"] for r in ranks)
    print(
        f"tiny model: L_moe={r0['L_moe']} K={r0['K']} E={r0['E']}; rollout engine bf16 + router-logit noise "
        f"std {noise}; {n} response tokens over {len(ranks)} ranks"
    )
    print("\n(a) routes the learner used vs the rollout's, and rollout-vs-learner mismatch")
    print(f"{'':34}{'replay off':>12}{'r3':>12}")
    native = {
        k: pooled("off", f"routing/{k}")
        for k in ("flip_router_frac", "flip_token_frac", "flip_layers_per_token")
    }
    rows = [
        ("flip, router decisions", native["flip_router_frac"], 0.0),
        ("flip, tokens (any layer)", native["flip_token_frac"], 0.0),
        ("flipped layers per token", native["flip_layers_per_token"], 0.0),
    ]
    for mode in ("off", "r3"):
        ranks_k3 = sum(r[mode]["k3_sum"] for r in ranks) / n
        ranks_f2 = sum(r[mode]["f2_sum"] for r in ranks) / n
        if mode == "off":
            k3_off, f2_off = ranks_k3, ranks_f2
        else:
            k3_r3, f2_r3 = ranks_k3, ranks_f2
    rows += [("k3 KL(rollout || learner)", k3_off, k3_r3), ("F(2)", f2_off, f2_r3)]
    for label, a, b in rows:
        print(f"{label:34}{a:12.4g}{b:12.4g}")
    print(f"{'k3 ratio r3/off':34}{k3_r3 / k3_off:24.3f}")
    print(
        "(under r3 the learner routes every recorded row through the rollout's experts: 0 flips by "
        f"construction; its native router still disagrees on {native['flip_router_frac']:.1%} of decisions)"
    )
    off = statistics.median(t for r in ranks for t in r["step_s"]["off"])
    r3 = statistics.median(t for r in ranks for t in r["step_s"]["r3"])
    print(f"\n(b) learner update step: off {off * 1e3:.1f} ms, r3 {r3 * 1e3:.1f} ms (medians)")
    print(f"    {ratio_line('ratio r3/off', _per_rep_ratios(ranks, 'r3', 'off'))}")
    metrics = statistics.median(t for r in ranks for t in r["metrics_s"])
    print(
        f"    of which the agreement metrics (once per pass, timed directly): {metrics * 1e3:.1f} ms; "
        f"forcing the routes: {(r3 - off - metrics) * 1e3:.1f} ms"
    )
    print(
        f"\n(c) route bytes per token: {r0['bytes_per_token']} (L_moe x K x 1 byte = {r0['L_moe'] * r0['K']})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router-noise", type=float, default=0.05)
    ap.add_argument("--prompts", type=int, default=64, help="prompts per rank (4 samples each)")
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    from moe_rl.launch import spawn_local

    load = MachineLoad()
    _report(spawn_local(_measure, 2, args)[0], args.router_noise)
    print(load.line(2))


if __name__ == "__main__":
    main()
