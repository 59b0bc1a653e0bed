"""Multi-turn routes, measured in one run on the embedded default (issue 44 point 8; docs/agentic.md 9).

    python scripts/bench_agent.py [--prompts 16] [--samples 8] [--turns 4] [--reps 6] [--quick]

The calculator environment's conversations on the built-in engine with its prefix cache (bf16, the
run's defaults), one process, 1 thread. Interleaved reps (append, full, then full, append, ...):
  (a) the rollout of a step with append-only routes and provenance (the loop) against the same
      rollout where every turn takes and replaces the whole sequence's routes (``route_return=full``,
      as verl's loop does): the median of the paired wall-time and CPU-time ratios with their
      intervals (scripts/bench_stats.py; on a loaded machine the CPU time is the work, the wall time
      mostly the wait). Only the rollout differs: both give the learner the same batch;
  (b) route bytes per trajectory (ids and provenance taken from the engine, all turns) by the
      number of turns, for both: linear against quadratic;
  (c) the verifier at its defaults (routing.verify: 4 samples every 10 steps): its seconds against
      the rollout's, so its share of a step is at most that (a step also trains);
  (d) the clean run's mismatch rate of every trajectory, at margin 0 and at the default margin.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench_stats import MachineLoad, paired_ratios, ratio_line


def _setup(args):
    import torch

    from moe_rl.config import load_config
    from moe_rl.rollout.prefix_cache import PrefixCachedEngine
    from moe_rl.step.plan import sampling_params
    from moe_rl.tasks.task import build_task
    from moe_rl.weights.warmstart import load_init_weights

    torch.set_num_threads(1)
    over = ["agent.env=calculator", "agent.max_turn_tokens=12", f"agent.max_turns={args.turns}"]
    cfg, task = build_task(load_config(None, over), start_pool=False)
    engine = PrefixCachedEngine(cfg.model, max_blocks=4096, block_tokens=16, pad_id=task.tokenizer.pad_id)
    engine.load_weights(load_init_weights(cfg.init_weights, cfg.model, task.tokenizer))
    return cfg, task, engine, sampling_params(cfg, task.tokenizer.eos_ids)


def _bytes_by_turns(path: Path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["turns"], []).append(rec["route_bytes"])
    return out


def main(args) -> None:
    from moe_rl.config.route_verify import verify_every
    from moe_rl.metrics import reduce_metrics
    from moe_rl.routing.verify import VerifyPlan, verify_batch

    cfg, task, engine, sampling = _setup(args)
    loop, load, v = task.agent, MachineLoad(), cfg.routing.verify
    every = verify_every(cfg)
    layers = tuple(cfg.model.moe_layers)
    default_plan = VerifyPlan(every, v.samples, v.margin, layers, args.turns)
    times: dict[str, list[float]] = {"append": [], "full": []}
    cpu: dict[str, list[float]] = {"append": [], "full": []}  # this process's CPU s: the work, under load
    verify_s, clean = [], {0.0: [0.0, 0.0], v.margin: [0.0, 0.0]}
    tmp = Path(tempfile.mkdtemp(prefix="bench_agent_"))
    for mode in times:
        (tmp / f"{mode}.jsonl").write_text("")
    for rep in range(args.reps):
        prompts = task.source.sample_step(rep, args.prompts, 0, 1, 7)
        for mode in ("append", "full") if rep % 2 == 0 else ("full", "append"):
            loop.route_return, loop.log_path = mode, tmp / f"{mode}.jsonl"
            engine.prefix.clear()  # each arm starts cold, as a step after a weight sync does
            t0, c0 = time.perf_counter(), time.process_time()
            batch = loop.rollout(engine, prompts, args.samples, sampling, seed=rep)
            times[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
            if mode == "append":
                m = reduce_metrics(verify_batch(engine, batch, default_plan, seed=rep))
                verify_s.append(m["time/verify_s"])
                for margin in clean:  # every trajectory, to count the clean run's mismatches
                    plan = VerifyPlan(1, batch.num_seqs, margin, layers, args.turns)
                    mm = verify_batch(engine, batch, plan, seed=rep)["routing/verify_mismatch_frac"]
                    clean[margin][0] += float(mm.sum)
                    clean[margin][1] += float(mm.count)
        print(
            f"rep {rep}: rollout s append {times['append'][-1]:.3f} full {times['full'][-1]:.3f}, "
            f"verify s {verify_s[-1]:.4f}"
        )
    print(ratio_line("rollout time full / append:", paired_ratios(times["full"], times["append"])))
    print(ratio_line("rollout CPU time full / append:", paired_ratios(cpu["full"], cpu["append"])))
    app, full = _bytes_by_turns(tmp / "append.jsonl"), _bytes_by_turns(tmp / "full.jsonl")
    print("route bytes per trajectory by turns (mean): turns | append | full | full / append")
    for k in sorted(set(app) & set(full)):
        a, f = statistics.mean(app[k]), statistics.mean(full[k])
        print(f"turns {k}: {a:.0f} {f:.0f} {f / a:.3f} ({len(app[k])} and {len(full[k])} trajectories)")
    share = [s / every / r for s, r in zip(verify_s, times["append"])]
    print(
        f"verifier: {v.samples} samples every {every} steps; {statistics.median(verify_s):.4f} s a verify "
        f"(median), {statistics.median(share):.5f} of the rollout per step at that interval "
        f"(median; max {max(share):.5f})"
    )
    for margin, (bad, pairs) in clean.items():
        print(
            f"clean run, margin {margin:g}: {bad:.0f} of {pairs:.0f} compared (row, layer) pairs "
            f"mismatch = {bad / max(pairs, 1):.6f}"
        )
    print(load.line(1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="2 prompts x 2 samples, 2 reps (the test's size)")
    a = p.parse_args()
    if a.quick:
        a.prompts, a.samples, a.reps = 2, 2, 2
    main(a)
