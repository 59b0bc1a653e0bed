"""Rewrite every number of the H100 recipes' headers (configs/*x8h100.yaml) and of the README's
recipe table from moe_rl/memory/'s estimate; tests/test_configs.py recomputes each of them.

    python scripts/recipe_numbers.py          # rewrite in place
    python scripts/recipe_numbers.py --check  # exit 1 when a number differs
    python scripts/recipe_numbers.py --table  # the per-phase table of docs/design.md 14.3
    python scripts/recipe_numbers.py --fp8    # FP8 rollouts against bf16: docs/gpu.md's FP8 table

The layout and vLLM TP are the config's own: the script writes what they give, it does not choose
them (``moe-rl estimate CONFIG --rank 3`` ranks the layouts)."""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

from moe_rl.config import load_config
from moe_rl.memory import DGX_H100_USABLE_HOST_GIB, Layout, estimate, rank_layouts, rollout_peaks

ROOT = Path(__file__).resolve().parents[1]
# the estimate keys each header states, in order
KEYS = (
    "weights_gib", "grads_gib", "optimizer_gib", "learner_static_gib", "activations_gib", "logits_gib",
    "train_peak_gib", "sync_peak_gib", "learner_rollout_gib", "vllm_budget_gib", "vllm_weights_gib",
    "vllm_kv_tokens", "rollout_peak_gib", "host_gib_per_rank", "host_gib_per_node", "cpu_adam_s",
    "sync_gb_per_rank", "sync_s", "offload_s",
)  # fmt: skip
LABELS = {"qwen3_30b": "Qwen3-30B-A3B", "qwen3_235b": "Qwen3-235B-A22B", "glm45": "GLM-4.5-355B"}
LABELS |= {"deepseek_v3": "DeepSeek-V3-671B", "kimi_k2": "Kimi-K2-1T"}


def _value(key: str, v: float) -> str:
    return f"{v:.0f}" if key == "vllm_kv_tokens" else f"{v:.1f}"


def fewer_nodes(path: Path, fewer: int, vtp: int):
    """The layouts ``rank_layouts`` lists on ``fewer`` nodes with vLLM TP ``vtp`` (the header's
    'Why N nodes'; tests/test_configs.py checks it): the layout keys free, the rest the recipe's."""
    free = [f"parallel.nproc={fewer * 8}", "parallel.pipeline_parallel=1", "parallel.tensor_parallel=1"]
    free += ["parallel.expert_parallel=1", "parallel.expert_tensor_parallel=0", "algo.num_minibatches=1"]
    free += ["parallel.layers_in_first_stage=0", "parallel.layers_in_last_stage=0"]
    free += [f"rollout.prompts_per_step={fewer * 32}", f"rollout.vllm.tensor_parallel={vtp}"]
    return rank_layouts(load_config(path, free), fewer, 8)


def why_text(ranked) -> str:
    """Why the fewer nodes do not do: no layout fits the GPU (the best one's peak), or every one
    that does needs more host memory per node than DGX_H100_USABLE_HOST_GIB (the least of them)."""
    fit = [r for r in ranked if r.fits]
    if not fit:
        e = ranked[0].est
        peak = max(e[k] for k in ("train_peak_gib", "sync_peak_gib", "rollout_peak_gib"))
        return (
            f"no layout fits: the best peaks at {peak:.1f} GiB per GPU with {e['vllm_kv_tokens']:,.0f} "
            "vLLM KV tokens (the same offload and CPU Adam)."
        )
    host = min(r.est["host_gib_per_node"] for r in fit)
    return (
        f"the layouts that fit the GPU need {host:,.0f} GiB or more of host memory per node, above "
        f"the {DGX_H100_USABLE_HOST_GIB:,} GiB a 2 TB node has for them (docs/design.md 14.1)."
    )


def _comment(text: str) -> str:
    return "".join(f"# {line}\n" for line in textwrap.wrap(text, 98))


WHY = re.compile(r"# Why (\d+) nodes: on (\d+) nodes \(vLLM TP (\d+)\) (?:.|\n)*?(?=#\n)")


def header(path: Path, text: str) -> tuple[str, dict]:
    cfg = load_config(path)
    nodes = int(path.stem.split("_")[-1].split("x")[0])
    lay, est = Layout.of(cfg.parallel), estimate(cfg)
    block = "".join(f"#     {k} = {_value(k, est[k])}\n" for k in KEYS)
    text = re.sub(r"(#   memory estimate:\n)(#     \w+ = [\d.]+\n)+", lambda m: m.group(1) + block, text)
    desc = f"{lay.describe(cfg.model.num_layers)}, DP={lay.dp}, expert-DP={lay.expert_dp}."
    text = re.sub(r"(# expert-TP 1, smallest EP\): ).*\n", lambda m: m.group(1) + desc + "\n", text)
    vtp = cfg.rollout.vllm.tensor_parallel
    text = re.sub(
        r"one vLLM engine per \d+ GPUs \(vLLM TP=\d+\)",
        f"one vLLM engine per {vtp} GPUs (vLLM TP={vtp})",
        text,
    )
    without, _ = rollout_peaks(cfg)
    text = re.sub(r"(The rollout peak without it: )[\d.]+", lambda m: f"{m.group(1)}{without:.1f}", text)
    if cfg.optim.cpu_adam:
        gpu = estimate(replace(cfg, optim=replace(cfg.optim, cpu_adam=False)))["train_peak_gib"]
        text = re.sub(r"(this layout's training peak is )[\d.]+", lambda m: f"{m.group(1)}{gpu:.1f}", text)
    why = WHY.search(text)
    if why:
        n, fewer, fvtp = (int(g) for g in why.groups())
        assert n == nodes, (path.name, n)
        said = f"Why {n} nodes: on {fewer} nodes (vLLM TP {fvtp}) " + why_text(fewer_nodes(path, fewer, fvtp))
        text = text[: why.start()] + _comment(said) + text[why.end() :]
    return text, {"cfg": cfg, "est": est, "nodes": nodes, "lay": lay, "without": without}


def readme_row(path: Path, r: dict) -> str:
    cfg, est, lay = r["cfg"], r["est"], r["lay"]
    label = next(v for k, v in LABELS.items() if path.name.startswith(k))
    cell = f"TP {lay.tp} x EP {lay.ep}" if lay.tp > 1 else f"EP {lay.ep}"
    cell += f" x PP {lay.pp}" if lay.pp > 1 else ""
    cell += f", vLLM TP {cfg.rollout.vllm.tensor_parallel}" + (", CPU Adam" if cfg.optim.cpu_adam else "")
    return (
        f"| `configs/{path.name}` | {label} | {r['nodes']} x 8 | {cell} | {est['train_peak_gib']:.1f} | "
        f"{est['sync_peak_gib']:.1f} | {r['without']:.1f} / {est['rollout_peak_gib']:.1f} | "
        f"{est['host_gib_per_node']:,.0f} GiB | "
        f"{est['sync_gb_per_rank']:,.0f} GB, {est['sync_s']:.2f} s line rate, "
        f"{est['sync_s_peers_lo']:g}-{est['sync_s_peers_hi']:g} s at the peers' |"
    )


def table() -> str:
    """Every recipe's phase peaks (GiB a GPU), host memory, CPU Adam's step and the sync."""
    rows = [
        "| recipe | nodes | train | sync | generate | host per rank / node (GiB) | CPU Adam a step | "
        "sync per engine rank | line rate | peers measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted((ROOT / "configs").glob("*x8h100.yaml")):
        _, r = header(path, path.read_text())
        e = r["est"]
        label = next(v for k, v in LABELS.items() if path.name.startswith(k))
        adam = f"{e['cpu_adam_s']:.1f} s" if r["cfg"].optim.cpu_adam else "(GPU Adam)"
        rows.append(
            f"| {label} | {r['nodes']} x 8 | {e['train_peak_gib']:.1f} | {e['sync_peak_gib']:.1f} | "
            f"{e['rollout_peak_gib']:.1f} | {e['host_gib_per_rank']:,.0f} / {e['host_gib_per_node']:,.0f} | "
            f"{adam} | {e['sync_gb_per_rank']:,.1f} GB | {e['sync_s']:.2f} s | "
            f"{e['sync_s_peers_lo']:g}-{e['sync_s_peers_hi']:g} s |"
        )
    return "\n".join(rows)


FP8 = "rollout.quantization=fp8"


def fp8_row(path: Path) -> str:
    """One recipe with ``rollout.quantization=fp8`` against its bf16 engine, at the recipe's layout:
    the engine's weights a GPU, the KV tokens its budget leaves, the rollout peak, and whether the
    FP8 run fits on one node fewer; or vLLM's refusal (a vLLM TP whose shards split a block)."""
    from moe_rl.errors import ConfigError
    from moe_rl.memory.estimate import unfit_phase

    cfg, nodes = load_config(path), int(path.stem.split("_")[-1].split("x")[0])
    label = next(v for k, v in LABELS.items() if path.name.startswith(k))
    vtp = cfg.rollout.vllm.tensor_parallel
    refused, tp, fcfg = "", vtp, None
    while tp >= 1 and fcfg is None:  # the recipe's vLLM TP, else the largest divisor of it that tiles
        try:
            fcfg = load_config(path, [FP8, f"rollout.vllm.tensor_parallel={tp}"])
        except ConfigError as e:
            refused = refused or str(e).split(": ", 2)[-1].split(";")[0]
            tp = max((d for d in range(1, tp) if vtp % d == 0), default=0)
    if fcfg is None:
        return f"| {label} | {nodes} x 8 | vLLM TP {vtp}: {refused}; no TP tiles |||||"
    engine = f"vLLM TP {vtp}" if not refused else f"vLLM TP {vtp}: {refused}; TP {tp} tiles"
    b, f = estimate(replace(cfg, rollout=replace(cfg.rollout, vllm=fcfg.rollout.vllm))), estimate(fcfg)
    fewer = "-"
    if nodes > 1:
        try:
            ranked = fewer_nodes_fp8(path, nodes - 1, tp)
            fewer = "yes" if any(r.fits for r in ranked) else "no"
        except ConfigError:
            fewer = f"refused (TP {tp} on {nodes - 1} nodes)"
    return (
        f"| {label} | {nodes} x 8 | {engine} | {b['vllm_weights_gib']:.1f} -> {f['vllm_weights_gib']:.1f} | "
        f"{b['vllm_kv_tokens']:,.0f} -> {f['vllm_kv_tokens']:,.0f} | {b['rollout_peak_gib']:.1f} -> "
        f"{f['rollout_peak_gib']:.1f} | {_fit(unfit_phase(fcfg, f))} | {fewer} |"
    )


def _fit(phase: str | None) -> str:
    return "fits" if phase is None else f"does not fit ({phase})"


def fewer_nodes_fp8(path: Path, fewer: int, vtp: int):
    free = [f"parallel.nproc={fewer * 8}", "parallel.pipeline_parallel=1", "parallel.tensor_parallel=1"]
    free += ["parallel.expert_parallel=1", "parallel.expert_tensor_parallel=0", "algo.num_minibatches=1"]
    free += ["parallel.layers_in_first_stage=0", "parallel.layers_in_last_stage=0"]
    free += [f"rollout.prompts_per_step={fewer * 32}", f"rollout.vllm.tensor_parallel={vtp}", FP8]
    return rank_layouts(load_config(path, free), fewer, 8)


def fp8_table() -> str:
    rows = [
        "| recipe | nodes | FP8 engine | vLLM weights a GPU (GiB) at its TP, bf16 -> FP8 | vLLM KV tokens | "
        "rollout peak (GiB) | FP8 at the recipe's learner layout | FP8 on one node fewer (any layout) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows += [fp8_row(p) for p in sorted((ROOT / "configs").glob("*x8h100.yaml"))]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--fp8", action="store_true")
    a = ap.parse_args()
    if a.fp8:
        print(fp8_table())
        return 0
    if a.table:
        print(table())
        return 0
    readme_path = ROOT / "README.md"
    readme, stale = readme_path.read_text(), []
    for path in sorted((ROOT / "configs").glob("*x8h100.yaml")):
        old = path.read_text()
        new, r = header(path, old)
        row = readme_row(path, r)
        readme_new = re.sub(rf"^\| `configs/{re.escape(path.name)}` \|.*$", row, readme, flags=re.MULTILINE)
        if new != old or readme_new != readme:
            stale.append(path.name)
        readme = readme_new
        if not a.check:
            path.write_text(new)
    if not a.check:
        readme_path.write_text(readme)
    print(("stale: " + ", ".join(stale)) if stale else "every recipe number is current")
    return 1 if a.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
