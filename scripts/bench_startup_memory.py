"""Host memory of a real start-up and one training step, against what each rank must hold.

    python scripts/bench_startup_memory.py [--layers 2] [--experts 32] [--hidden 1024]
        [--moe-ffn 512] [--vocab 1024] [--work DIR]

Writes a transformers-built Qwen3-MoE checkpoint in bf16 (``--hidden``, ``--experts`` experts of
``--moe-ffn``, ``--layers`` layers, 16 heads of 64, 4 kv groups, top-8), then runs ``moe-rl
train`` from it as a new user would: 2 local ranks, EP=2, ``steps=1`` (small rollouts, so the
step stays short on a CPU). It polls /proc of the launcher and its ranks every 50 ms for their
peak RSS (VmHWM) and prints each one against the arithmetic of what that process must hold
(docs/design.md 2.2): a rank's shard of the learner (fp32 weights, fp32 grads, Adam's two fp32
moments, split over data-parallel ranks by the distributed optimizer) plus the built-in engine's
whole bf16 copy; the launcher holds no model. With the run's ``memory_timeline.jsonl`` (where the
code writes one) it also prints each rank's peak per phase.

Run from any checkout (the one whose code is measured is the one on PYTHONPATH / this file's
repository): docs/measurements.md 8 has the before/after numbers and commands.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30


def make_checkpoint(out: Path, args) -> int:
    """A random Qwen3-MoE in bf16, saved by transformers; returns its parameter count."""
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,  # no dense layer (every layer MoE): unused
        moe_intermediate_size=args.moe_ffn,
        num_experts=args.experts,
        num_experts_per_tok=8,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=512,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        norm_topk_prob=True,  # as Qwen3-30B-A3B's config (the learner renormalises the top-k)
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    return n


def rank_arithmetic(model, ep: int, world: int) -> dict[str, float]:
    """Bytes a rank must hold (EP=``ep`` over ``world`` ranks, TP=PP=1, distributed optimizer):
    its parameters P_r (every dense tensor, E/EP of each layer's experts) as fp32 weights and fp32
    grads, Adam's m and v split over the data-parallel ranks of each (dense: world, experts:
    world / EP), and the engine's whole model in bf16."""
    from moe_rl.weights.canonical import canonical_param_shapes

    dense = experts = 0
    for name, shape in canonical_param_shapes(model).items():
        n = 1
        for d in shape:
            n *= d
        if ".mlp.experts." in name:
            experts += n
        else:
            dense += n
    local = dense + experts // ep
    total = dense + experts
    adam = 8 * (dense / world + experts / ep / (world // ep))
    return {
        "params_total": total,
        "params_rank": local,
        "weights": 4 * local,
        "grads": 4 * local,
        "adam": adam,
        "engine": 2 * total,
        "must_hold": 4 * local + 4 * local + adam + 2 * total,
    }


def _status(pid: int) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {
        k: int(v.split()[0]) * 1024
        for k, v in (ln.split(":", 1) for ln in text.splitlines() if ":" in ln)
        if k in ("VmHWM", "VmRSS")
    }


def _ranks(launcher: int) -> list[int]:
    """The launcher's rank processes: the children of its rank server on a CPU machine
    (moe_rl/rank_server.py), else its direct children that multiprocessing spawned (not its
    resource tracker); their own children (reward workers) are not ranks."""
    import psutil

    try:
        children = psutil.Process(launcher).children()
        servers = [p for p in children if "multiprocessing.forkserver" in " ".join(p.cmdline())]
        if servers:
            return sorted(p.pid for s in servers for p in s.children())
        return sorted(
            p.pid
            for p in children
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())
        )
    except psutil.Error:
        return []


def run_and_poll(cmd: list[str], env: dict, log: Path, run: Path) -> tuple[int, list[dict]]:
    """(exit code, [peak VmHWM by process at the end of start-up, up to the checkpoint, over the
    whole run]), by process: 'launcher', 'rank 0', 'rank 1'. Start-up ends when rank 0 writes
    ``run/config.yaml`` (``trainer.open_run_dir``: after the learner, the engine, the resume and the
    first weight sync); the checkpoint starts when rank 0 makes its ``.tmp`` directory
    (moe_rl/learner/checkpoint.py, before megatron builds the state it saves)."""
    peaks: dict[str, int] = {}
    startup: dict[str, int] = {}
    to_checkpoint: dict[str, int] = {}
    ckpts = run / "checkpoints"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            who = {proc.pid: "launcher"}
            for i, pid in enumerate(_ranks(proc.pid)):
                who[pid] = f"rank {i}"  # in pid order (the ranks are alike here: EP=2)
            for pid, name in who.items():
                hwm = _status(pid).get("VmHWM", 0)
                peaks[name] = max(peaks.get(name, 0), hwm)
            if not startup and (run / "config.yaml").is_file():
                startup = dict(peaks)
            if not to_checkpoint and ckpts.is_dir() and any(ckpts.iterdir()):
                to_checkpoint = dict(peaks)
            time.sleep(0.05)
    return proc.returncode, [startup, to_checkpoint, peaks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-ffn", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--work", type=Path, default=None, help="directory for the checkpoint and run")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_startup_"))
    ckpt, run = work / "ckpt", work / "run"
    if not (ckpt / "config.json").is_file():
        n = make_checkpoint(ckpt, args)
        print(f"checkpoint: {ckpt} ({n / 1e9:.3f}B parameters, bf16)")
    sys.path.insert(0, str(REPO))
    from moe_rl.config import load_config

    train_args = [
        f"run_dir={run}",
        f"init_weights=hf:{ckpt}",
        "task.tokenizer=builtin:char",
        "parallel.nproc=2",
        "parallel.expert_parallel=2",
        "steps=1",
        "rollout.prompts_per_step=8",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=8",
        "log.wandb_mode=disabled",
        "log.progress_bar=false",
        "log.val_every=0",
    ]
    model = load_config(None, train_args).model
    need = rank_arithmetic(model, ep=2, world=2)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", *train_args]
    print("code:", REPO, "| command:", " ".join(cmd[1:]))
    t0 = time.monotonic()
    code, (startup, to_ckpt, peaks) = run_and_poll(cmd, env, work / "train.log", run)
    print(f"exit {code} after {time.monotonic() - t0:.0f} s (log: {work / 'train.log'})")
    print(
        f"model {need['params_total'] / 1e6:.1f}M params; a rank holds {need['params_rank'] / 1e6:.1f}M: "
        f"weights {need['weights'] / GiB:.2f} + grads {need['grads'] / GiB:.2f} + Adam "
        f"{need['adam'] / GiB:.2f} + engine copy {need['engine'] / GiB:.2f} = "
        f"{need['must_hold'] / GiB:.2f} GiB"
    )
    print("peak RSS, GiB: start-up | up to the checkpoint after step 1 | whole run; must hold (ratios)")
    for name in sorted(peaks):
        held = 0.0 if name == "launcher" else need["must_hold"]
        cols = [d.get(name, 0) for d in (startup, to_ckpt, peaks)]
        ratios = " (" + " | ".join(f"{c / held:.2f}x" for c in cols) + ")" if held else ""
        print(f"{name:>9}: " + " | ".join(f"{c / GiB:5.2f}" for c in cols) + f"; {held / GiB:5.2f}{ratios}")
    timeline = run / "memory_timeline.jsonl"
    if timeline.is_file():
        print("memory timeline (VmHWM at each phase's end, GiB; first step):")
        by_rank: dict[str, list[str]] = {}
        for rec in map(json.loads, timeline.read_text().splitlines()):
            by_rank.setdefault(str(rec["rank"]), []).append(f"{rec['phase']} {rec['peak_rss_gib']:.2f}")
        for rank, phases in sorted(by_rank.items()):
            print(f"  {rank}: " + ", ".join(phases))
    if code != 0:
        print((work / "train.log").read_text()[-3000:])
        sys.exit(code)


if __name__ == "__main__":
    main()
