"""Make the shipped warm-start checkpoints: supervised fine-tuning of the default tiny MoE with the
real megatron learner (1 rank), stopped as soon as the policy's sampled reward (at the rollout
temperature) reaches a target, so RL starts from a real but imperfect policy.

    python scripts/make_warmstart.py [--target 0.25] [--out moe_rl/assets/warmstart.safetensors]
    python scripts/make_warmstart.py --agent   # moe_rl/assets/warmstart_agent.safetensors

The first is supervised on the default single-turn task mix (docs/models.md 4). ``--agent`` starts
from that file and is supervised on expert transcripts of the calculator and lookup environments in
the compact tool format (``moe_rl/agentic/demos.py``), and measured through the real multi-turn
loop: it stops once the sampled tool-call success rate reaches ``--target-tools`` and the sampled
calculator reward ``--target`` (docs/agentic.md 7).

``--model KEY=VALUE`` (repeatable, single-turn only) makes the same warm start for another
architecture (``model.KEY``, e.g. ``num_experts=64``); a run loads it with ``init_weights=FILE``
and the same ``model.*`` overrides (docs/collapse_lab.md 4 uses it for the fine-grained FP8 lab).

Deterministic for a given --seed on the same software stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

import torch


def sft_batch(prompts, tok, device="cpu"):
    """prompt + answer + eos, right-padded; the loss covers the answer and eos tokens."""
    seqs = [p.prompt_ids + tok.encode(p.answer) + [tok.eos_id] for p in prompts]
    lens_B = torch.tensor([len(s) for s in seqs])
    tokens_BS = tok.pad(seqs)
    prompt_lens_B = torch.tensor([len(p.prompt_ids) for p in prompts])
    pos_S = torch.arange(tokens_BS.shape[1])
    mask_BS = (pos_S[None] >= prompt_lens_B[:, None]) & (pos_S[None] < lens_B[:, None])
    from moe_rl.types import TrainBatch

    return TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS)


def demo_batch(rows, tok):
    """Demonstrations (ids, mask), right-padded; the loss covers the assistant turns (and eos)."""
    from moe_rl.types import TrainBatch

    lens_B = torch.tensor([len(ids) for ids, _ in rows])
    tokens_BS = tok.pad([ids for ids, _ in rows])
    mask_BS = torch.zeros(tokens_BS.shape, dtype=torch.bool)
    for b, (_, mask) in enumerate(rows):
        mask_BS[b, : len(mask)] = torch.tensor(mask)
    return TrainBatch(tokens_BS, lens_B, loss_mask_BS=mask_BS)


# what each environment's loop is measured under: the calculator fits the default run (12 new tokens
# per turn, 64 in all); a lookup call is 14 tokens and a trajectory about 100
AGENT_LIMITS = {"calculator": (12, 64), "lookup": (16, 128)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agent", action="store_true", help="the agent warm start (tool calls, compact format)")
    ap.add_argument("--out", default="", help="default: moe_rl/assets/warmstart[_agent].safetensors")
    ap.add_argument(
        "--target",
        type=float,
        default=None,
        help="stop at this sampled reward (exact match; --agent: the calculator's; default 0.2 | 0.3)",
    )
    ap.add_argument(
        "--target-greedy",
        type=float,
        default=0.8,
        help="also require this greedy exact-match reward before stopping (single-turn)",
    )
    ap.add_argument(
        "--target-tools",
        type=float,
        default=0.9,
        help="--agent: also require this sampled tool-call success rate in both environments",
    )
    ap.add_argument(
        "--entropy-bonus",
        type=float,
        default=None,
        help="SFT loss = NLL - bonus * entropy: keeps the policy spread while its mode improves "
        "(default 0.25 | 0.05)",
    )
    ap.add_argument("--max-steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=None, help="default 1e-3 | 2e-3")
    ap.add_argument("--eval-every", type=int, default=None, help="default 10 | 20")
    ap.add_argument("--eval-prompts", type=int, default=128, help="--agent: trajectories per environment")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model.KEY override (repeatable), e.g. num_experts=32: a warm start for another "
        "architecture, loaded with init_weights=FILE and the same model.* keys",
    )
    args = ap.parse_args()
    if args.agent and args.model:  # the agent warm start starts from the shipped (default) file
        sys.stderr.write(
            "error: --model: only without --agent (it starts from the default-architecture file)\n"
        )
        raise SystemExit(2)
    # (single-turn | --agent): the agent's turns are each 5-12 tokens that must all be right, so a
    # smaller entropy bonus; evaluated every 20 steps, as the shipped file was made
    for name, single, agent in (("target", 0.2, 0.3), ("entropy_bonus", 0.25, 0.05), ("lr", 1e-3, 2e-3)):
        if getattr(args, name) is None:
            setattr(args, name, agent if args.agent else single)
    if args.eval_every is None:
        args.eval_every = 20 if args.agent else 10
    if not args.out:
        args.out = f"moe_rl/assets/warmstart{'_agent' if args.agent else ''}.safetensors"
    return args


def run_config(model_overrides: list[str]):
    """The default RunConfig with ``model.KEY=VALUE`` overrides, through the real config loader (an
    unknown key or a bad value is a ConfigError naming it)."""
    from moe_rl.config import load_config

    return load_config(None, [f"model.{kv}" for kv in model_overrides])


def main() -> None:
    args = parse_args()
    from moe_rl.errors import UserError, one_line

    try:
        base = run_config(args.model)
    except UserError as e:  # before anything starts: one line, exit 2
        sys.stderr.write(f"error: --model: {one_line(e)}\n")
        raise SystemExit(2) from None

    import megatron_patches
    from moe_rl import dist
    from moe_rl.config import ParallelConfig
    from moe_rl.learner.learner import Learner
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.tasks.task import resolve_vocab as resolve
    from moe_rl.tasks.tokenizer import CharTokenizer
    from moe_rl.weights.warmstart import BUILTIN, open_init_weights, save_init_weights

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    megatron_patches.apply_all()
    tok = CharTokenizer()
    cfg = resolve(base, tok)
    if args.agent:  # room for a lookup trajectory (max_seq_len is no architecture field)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_seq_len=128))
    par = ParallelConfig(nproc=1, expert_parallel=1)
    ctx = dist.init_distributed(par, args.seed)
    init = open_init_weights(BUILTIN, cfg.model, tok) if args.agent else None
    learner = Learner(cfg.model, par, cfg.optim, ctx, init)
    engine = BuiltinEngine(cfg.model, dtype="fp32", pad_id=tok.pad_id)

    def loss(mb, st, normalizer):
        return -((st.logp_BS + args.entropy_bonus * st.entropy_BS) * mb.loss_mask_BS).sum() / normalizer, {}

    run = agent_sft if args.agent else task_sft
    info = run(args, cfg, tok, learner, engine, loss)
    save_init_weights(args.out, learner.export_canonical(), cfg.model, tok, info)
    logging.info("wrote %s: %s", args.out, info)
    dist.shutdown()


def task_sft(args, cfg, tok, learner, engine, loss) -> dict:
    """The single-turn warm start: SFT on the default task mix until the sampled and greedy
    exact-match rewards reach their targets."""
    from moe_rl.step.plan import sampling_params
    from moe_rl.tasks.rewards import score
    from moe_rl.tasks.task import build_prompt_source

    t = cfg.task
    source = build_prompt_source(t.tasks, t.min_len, t.max_len, t.dataset, t.reward, tok)

    def evaluate(step: int, greedy: bool) -> float:
        engine.load_weights(learner.export_canonical())
        prompts = source.sample(256, seed=10_000_000 + step)
        sp = sampling_params(cfg, (tok.eos_id,))
        sp = dataclasses.replace(sp, top_k=1) if greedy else sp
        batch = engine.generate([p.prompt_ids for p in prompts], 1, sp, seed=step)
        rewards_B, _ = score(prompts, batch.response_ids(tok.pad_id), tok, 1)
        return float(rewards_B.mean())

    t0 = time.perf_counter()
    sampled, greedy, step = evaluate(0, False), evaluate(0, True), 0
    while (sampled < args.target or greedy < args.target_greedy) and step < args.max_steps:
        mb = sft_batch(source.sample(args.batch, seed=args.seed * 1_000_000 + step), tok)
        learner.update(mb, loss, 1.0, args.batch, args.lr)
        step += 1
        if step % args.eval_every == 0:
            sampled, greedy = evaluate(step, False), evaluate(step, True)
            logging.info(
                "sft step %d  exact-match sampled %.3f greedy %.3f  (%.0f s)",
                step,
                sampled,
                greedy,
                time.perf_counter() - t0,
            )
    return {
        "sft_steps": step,
        "sampled_exact_match": sampled,
        "greedy_exact_match": greedy,
        "seconds": round(time.perf_counter() - t0, 1),
        "seed": args.seed,
        "target": args.target,
        "target_greedy": args.target_greedy,
        "entropy_bonus": args.entropy_bonus,
        "lr": args.lr,
    }


def agent_sft(args, cfg, tok, learner, engine, loss) -> dict:
    """The agent warm start: SFT on expert transcripts of both environments (half each per batch),
    measured through the multi-turn loop until its sampled tool-call success rate (each
    environment) and the calculator's reward reach their targets."""
    import random

    from moe_rl.agentic.demos import demo_sequence
    from moe_rl.agentic.envs import Calculator, EnvPromptSource, Lookup
    from moe_rl.agentic.formats import CompactFormat
    from moe_rl.agentic.loop import AgentLoop
    from moe_rl.config import AgentConfig
    from moe_rl.step.plan import sampling_params

    fmt = CompactFormat(tok)
    envs = {"calculator": Calculator(), "lookup": Lookup()}

    def evaluate(step: int) -> dict[str, float]:
        engine.load_weights(learner.export_canonical())
        sp = sampling_params(cfg, (tok.eos_id,))
        out = {}
        for name, env in envs.items():
            turn_tokens, total = AGENT_LIMITS[name]
            loop = AgentLoop(env, fmt, AgentConfig(env=name, max_turn_tokens=turn_tokens), turn_tokens, total)
            prompts = EnvPromptSource(env, fmt).sample_step(
                10_000_000 + step, args.eval_prompts, 0, 1, args.seed
            )
            batch = loop.rollout(engine, prompts, 1, sp, seed=step)
            m = batch.engine_metrics
            rate = m["agent/tool_success_rate"]
            out[f"{name}_reward"] = round(float(batch.env_reward_B.mean()), 4)
            out[f"{name}_tool_success"] = round(float(rate.sum) / max(float(rate.count), 1.0), 4)
            out[f"{name}_turns"] = round(float(m["agent/turns_mean"].sum) / len(prompts), 3)
        return out

    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    scores, step = evaluate(0), 0

    def done(s: dict[str, float]) -> bool:
        tools = min(s[f"{n}_tool_success"] for n in envs)
        return s["calculator_reward"] >= args.target and tools >= args.target_tools

    while not done(scores) and step < args.max_steps:
        rows = [
            demo_sequence(env, env.generate(rng), fmt)
            for env in envs.values()
            for _ in range(args.batch // 2)
        ]
        learner.update(demo_batch(rows, tok), loss, 1.0, args.batch, args.lr)
        step += 1
        if step % args.eval_every == 0:
            scores = evaluate(step)
            logging.info("agent sft step %d  %s  (%.0f s)", step, scores, time.perf_counter() - t0)
    return {
        "sft_steps": step,
        **scores,
        "seconds": round(time.perf_counter() - t0, 1),
        "seed": args.seed,
        "target": args.target,
        "target_tools": args.target_tools,
        "entropy_bonus": args.entropy_bonus,
        "lr": args.lr,
    }


if __name__ == "__main__":
    main()
