"""Make the shipped warm-start checkpoint: supervised fine-tuning of the default tiny MoE on the
default task mix with the real megatron learner (1 rank), stopped as soon as the policy's sampled
exact-match reward (at the rollout temperature) reaches a target, so RL starts from a real but
imperfect policy.

    python scripts/make_warmstart.py [--target 0.25] [--out moe_rl/assets/warmstart.safetensors]

Deterministic for a given --seed on the same software stack.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="moe_rl/assets/warmstart.safetensors")
    ap.add_argument("--target", type=float, default=0.2, help="stop at this sampled exact-match reward")
    ap.add_argument(
        "--target-greedy",
        type=float,
        default=0.8,
        help="also require this greedy exact-match reward before stopping",
    )
    ap.add_argument(
        "--entropy-bonus",
        type=float,
        default=0.25,
        help="SFT loss = NLL - bonus * entropy: keeps the policy spread while its mode improves",
    )
    ap.add_argument("--max-steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import megatron_patches
    from moe_rl import dist
    from moe_rl.config import ParallelConfig, RunConfig
    from moe_rl.learner.learner import Learner
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.step.plan import sampling_params
    from moe_rl.tasks.rewards import score
    from moe_rl.tasks.task import build_prompt_source
    from moe_rl.tasks.task import resolve_vocab as resolve
    from moe_rl.tasks.tokenizer import CharTokenizer
    from moe_rl.weights.warmstart import save_init_weights

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
    cfg = resolve(RunConfig(), tok)
    par = ParallelConfig(nproc=1, expert_parallel=1)
    ctx = dist.init_distributed(par, args.seed)
    t = cfg.task
    source = build_prompt_source(t.tasks, t.min_len, t.max_len, t.dataset, t.reward, tok)
    learner = Learner(cfg.model, par, cfg.optim, ctx)
    engine = BuiltinEngine(cfg.model, dtype="fp32", pad_id=tok.pad_id)

    def loss(mb, st, normalizer):
        return -((st.logp_BS + args.entropy_bonus * st.entropy_BS) * mb.loss_mask_BS).sum() / normalizer, {}

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
    info = {
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
    save_init_weights(args.out, learner.export_canonical(), cfg.model, tok, info)
    logging.info("wrote %s: %s", args.out, info)
    dist.shutdown()


if __name__ == "__main__":
    main()
