"""Router-gradient monitor cost, measured side by side in one run (tiny model, EP=2, 2 local ranks).

    python scripts/bench_monitor.py [--prompts 16] [--reps 10]

One rollout batch (the default config's shape: 16 prompts x 8 samples per rank), then the
learner's part of an RL step (old-log-prob pass + 4 minibatch updates, lr 0 so every rep sees the
same weights) with the monitor on and off, interleaved (on/off, off/on, ...) so drift and other
load hit both alike. Prints the median learner time of each, their ratio (the median of the
paired per-rep ratios, with its 95% interval: scripts/bench_stats.py), the overhead as a share of
a whole step (rollout + learner), against the issue's 3% budget, and the machine load during the
run.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from bench_stats import MachineLoad, paired_ratios, ratio_line


def _measure(args) -> list[dict]:
    import torch

    import megatron_patches
    from moe_rl import dist
    from moe_rl.config import LogConfig, RunConfig
    from moe_rl.learner.learner import Learner
    from moe_rl.rollout.factory import build_engine
    from moe_rl.step.plan import StepPlan, sampling_params
    from moe_rl.step.prepare import old_logprobs, prepare_batch
    from moe_rl.step.update import update_policy
    from moe_rl.tasks.rewards import score
    from moe_rl.tasks.task import build_prompt_source
    from moe_rl.tasks.task import resolve_vocab as resolve
    from moe_rl.tasks.tokenizer import CharTokenizer
    from moe_rl.weights.warmstart import load_init_weights

    torch.set_num_threads(1)
    megatron_patches.apply_all()
    tok = CharTokenizer()
    cfg_on = resolve(RunConfig(), tok)
    cfg_off = dataclasses.replace(cfg_on, log=LogConfig(router_monitor=False))
    ctx = dist.init_distributed(cfg_on.parallel, seed=0)
    init = load_init_weights(cfg_on.init_weights, cfg_on.model, tok)
    learners = {
        name: Learner(cfg_on.model, cfg_on.parallel, cfg_on.optim, ctx, init, monitor=name == "on")
        for name in ("on", "off")
    }  # the same weights; lr 0 keeps them the same
    plans = {"on": StepPlan.from_config(cfg_on), "off": StepPlan.from_config(cfg_off)}  # routing.replay=off
    learner, monitor = learners["on"], learners["on"].monitor
    engine = build_engine(cfg_on, tok.pad_id)
    engine.load_weights(learner.export_canonical())
    t, r = cfg_on.task, cfg_on.rollout
    source = build_prompt_source(t.tasks, t.min_len, t.max_len, "", t.reward, tok)
    prompts = source.sample(args.prompts, seed=ctx.dp_rank)
    t0 = time.perf_counter()
    sampling = sampling_params(cfg_on, (tok.eos_id,))
    batch = engine.generate([p.prompt_ids for p in prompts], r.samples_per_prompt, sampling, seed=ctx.dp_rank)
    rollout_s = time.perf_counter() - t0
    rewards_B, _ = score(
        prompts, batch.response_ids(tok.pad_id), tok, r.samples_per_prompt, task_names=source.task_names
    )
    # the monitor's own code, timed directly (robust to other load on the machine): its hooks,
    # the update passes' comparison with the old pass's routes, and the once-per-step reduction
    inside = [0.0]

    def timed(fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                inside[0] += time.perf_counter() - t0

        return wrapper

    monitor.observe_forward, monitor.observe_grad = (
        timed(monitor.observe_forward),
        timed(monitor.observe_grad),
    )
    learner.router_monitor_metrics = timed(learner.router_monitor_metrics)
    learner.replay.collector.finish = timed(learner.replay.collector.finish)
    times: dict[str, list[float]] = {"on": [], "off": []}
    own: list[float] = []
    for rep in range(args.reps + 1):
        for name in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            torch.distributed.barrier()
            inside[0] = 0.0
            t0 = time.perf_counter()
            old = old_logprobs(plans[name], learners[name], batch)
            tb, _ = prepare_batch(plans[name], learners[name], old, rewards_B)
            m = update_policy(plans[name], learners[name], tb, lr=0.0)
            torch.distributed.barrier()
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
                if name == "on":
                    own.append(inside[0])
            assert ("router_grad/zero_frac" in m) == (name == "on")
    res = {"times": times, "own": own, "rollout_s": rollout_s, "tokens": int(batch.response_mask_BS.sum())}
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, res)
    dist.shutdown()
    return gathered  # spawn_local hands every rank's return value back


def _report(ranks: list[dict]) -> None:
    on = statistics.median(t for r in ranks for t in r["times"]["on"])
    off = statistics.median(t for r in ranks for t in r["times"]["off"])
    rollout = statistics.median(r["rollout_s"] for r in ranks)
    n = len(ranks[0]["times"]["on"])
    print(
        f"tiny model, default batch; {sum(r['tokens'] for r in ranks)} response tokens "
        f"over {len(ranks)} ranks; "
        f"{n} interleaved reps each"
    )
    print(
        f"learner part of a step (old log-probs + 4 minibatch updates): monitor off {off * 1e3:.1f} ms, "
        f"on {on * 1e3:.1f} ms (medians)"
    )

    def per_rep(name):  # the ranks' mean per rep (barrier-synchronised, so nearly equal)
        return [statistics.fmean(ts) for ts in zip(*(r["times"][name] for r in ranks))]

    print(ratio_line("ratio on/off", paired_ratios(per_rep("on"), per_rep("off"))))
    print(f"rollout of the same batch: {rollout * 1e3:.1f} ms")
    share = (on - off) / (off + rollout)
    print(f"monitor overhead as a share of a whole step (rollout + learner): {share:+.2%} (budget 3%)")
    own = statistics.median(t for r in ranks for t in r["own"])
    print(
        f"time inside the monitor's own code (hooks, flip comparison, reduction), timed directly: "
        f"{own * 1e3:.1f} ms = {own / (on + rollout):.2%} of a step with it"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="prompts per rank (8 samples each)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    from moe_rl.launch import spawn_local

    load = MachineLoad()
    _report(spawn_local(_measure, 2, args)[0])
    print(load.line(2))


if __name__ == "__main__":
    main()
