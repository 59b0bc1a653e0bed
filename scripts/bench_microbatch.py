"""Fixed-size vs token-budget micro-batches, side by side in one run (issue 13, point 4).

    python scripts/bench_microbatch.py [--seqs 32] [--micro-batch-size 4] [--max-tokens 4096] [--reps 3]

One learner rank (a tiny MoE, max_seq_len 2048) takes a mixed-length batch (lengths uniform in
[20, 2000] tokens, seeded) and runs a full update pass (forward + backward over every micro-batch)
with ``algo.micro_batch_size`` sequences per micro-batch, then with ``algo.max_tokens_per_micro_batch``
(sorted by length, bucketed). Prints, for each: micro-batches, padded tokens / real tokens, and the
median pass time over interleaved repetitions (the first round warms up); then the pass-time ratio
token-budget/fixed (median of the paired per-rep ratios, with its 95% interval:
scripts/bench_stats.py) and the machine load during the run.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_stats import MachineLoad, paired_ratios, ratio_line


def _measure(args) -> dict:
    import torch

    import megatron_patches
    from moe_rl import dist
    from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
    from moe_rl.learner.learner import Learner
    from moe_rl.types import TrainBatch
    from moe_rl.weights.canonical import random_canonical_weights

    torch.set_num_threads(1)
    megatron_patches.apply_all()
    model = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=96,
        moe_ffn_hidden_size=32,
        num_experts=4,
        moe_router_topk=2,
        max_seq_len=2048,
    )
    par = ParallelConfig(nproc=1, expert_parallel=1)
    ctx = dist.init_distributed(par, seed=0)
    g = torch.Generator().manual_seed(args.seed)
    lens_B = torch.randint(20, 2001, (args.seqs,), generator=g)
    pos_S = torch.arange(int(lens_B.max()))
    tokens_BS = torch.randint(3, model.vocab_size, (args.seqs, pos_S.numel()), generator=g) * (
        pos_S < lens_B[:, None]
    )
    batch = TrainBatch(tokens_BS, lens_B, loss_mask_BS=(pos_S >= 10) & (pos_S < lens_B[:, None]))
    weights = random_canonical_weights(model, seed=0)
    learners = {
        "fixed": Learner(model, par, OptimConfig(), ctx, weights, monitor=False),
        "token-budget": Learner(
            model, par, OptimConfig(), ctx, weights, monitor=False, max_tokens_per_micro_batch=args.max_tokens
        ),
    }

    def nll(mb, st, normalizer):
        return -(st.logp_BS * mb.loss_mask_BS).sum() / normalizer, {}

    res = {"real": int(lens_B.sum()), "lens": (int(lens_B.min()), int(lens_B.max()))}
    for name, learner in learners.items():
        mbs, _ = learner._micro_batches(batch, args.micro_batch_size)
        res[name] = {"num": len(mbs), "padded": sum(mb.tokens_BS.numel() for mb in mbs), "times": []}
    for rep in range(args.reps + 1):
        for name in ("fixed", "token-budget") if rep % 2 == 0 else ("token-budget", "fixed"):
            t0 = time.perf_counter()
            learners[name].forward_backward(batch, nll, 1.0, args.micro_batch_size)
            if rep:
                res[name]["times"].append(time.perf_counter() - t0)
    dist.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from moe_rl.launch import spawn_local

    load = MachineLoad()
    res = spawn_local(_measure, 1, args)[0]
    print(
        f"{args.seqs} sequences, lengths {res['lens'][0]}..{res['lens'][1]} tokens, "
        f"{res['real']} real tokens; "
        f"one rank, update pass (forward + backward), median of {args.reps}"
    )
    print(f"{'':36}{'micro-batches':>14}{'padded/real':>13}{'pass time (s)':>15}")
    for name, label in (
        ("fixed", f"fixed, {args.micro_batch_size} seqs each"),
        ("token-budget", f"token budget, <= {args.max_tokens} tokens"),
    ):
        r = res[name]
        print(
            f"{label:36}{r['num']:>14}{r['padded'] / res['real']:>13.3f}"
            f"{statistics.median(r['times']):>15.2f}"
        )
    print(
        ratio_line(
            "pass time ratio token-budget/fixed",
            paired_ratios(res["token-budget"]["times"], res["fixed"]["times"]),
        )
    )
    print(load.line(1))


if __name__ == "__main__":
    main()
