"""One table for the GPU smoke's runs: python scripts/gpu_smoke_summary.py RUN_DIR [RUN_DIR ...].

Per run: steps, step time, tokens/s, MFU of the whole step and of the learner alone, peak device
memory (torch's allocator; and the device's own, from nvidia-smi, where the run dir has a
``device_peak_mib`` file: vLLM's memory pool included) against ``moe-rl estimate``'s larger peak
for this GPU (``--gpu-gib``), the weight sync's seconds, routing agreement (1 - routing/flip_router_frac),
rollout-vs-learner k3 KL, and the mean
reward of the first and last quarter of the steps. Then, per run with the device's samples
(``device_samples.csv``: nvidia-smi's time and used MiB every 200 ms), each phase's device peak
(train, sync, generate: the highest sample inside the run's memory-timeline spans of that phase)
beside the estimate's peak of the phase (docs/design.md 14.2). Pairs named X_off / X_r3 also get
the r3/off step-time ratio. Exit 1 if a ``tiny_*`` run's reward did not rise. The arithmetic is
moe_rl.memory.summarize_run (unit-tested on CPU)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

from moe_rl.config import load_config
from moe_rl.memory import H100_BF16_DENSE_TFLOPS, estimate, summarize_run
from moe_rl.memory.estimate import phase_peak_gib
from moe_rl.memory.runs import SPANS_OF_PHASE, phase_device_peaks

COLUMNS = (
    "run",
    "steps",
    "step_s",
    "tokens/s",
    "MFU%",
    "learner_MFU%",
    "peak_GiB",
    "device_GiB",
    "est_GiB",
    "sync_s",
    "agree",
    "k3_kl",
    "reward first->last",
)


def row(run: Path, prompt_tokens: float, peak_tflops: float, gpu_gib: float) -> tuple[dict, list[str]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = load_config(run / "config.yaml")
    s = summarize_run(rows, cfg, prompt_tokens=prompt_tokens, peak_tflops=peak_tflops)
    est = estimate(cfg, gpu_gib)
    s["est_gib"] = max(est["train_peak_gib"], est["rollout_peak_gib"])
    device = run / "device_peak_mib"
    if device.is_file() and device.read_text().strip():
        s["device_gib"] = float(device.read_text()) / 1024

    def fmt(key, spec, scale=1.0):
        return format(s[key] * scale, spec) if key in s else "n/a"

    return s, [
        run.name,
        fmt("steps", ".0f"),
        fmt("step_s", ".3f"),
        fmt("tokens_per_s", ",.0f"),
        fmt("mfu", ".2f", 100),
        fmt("learner_mfu", ".2f", 100),
        fmt("peak_gib", ".1f"),
        fmt("device_gib", ".1f"),
        fmt("est_gib", ".1f"),
        fmt("sync_s", ".2f"),
        fmt("routing_agreement", ".4f"),
        fmt("corr/k3_kl", ".2e"),
        f"{fmt('reward_first', '.3f')}->{fmt('reward_last', '.3f')}",
    ]


def device_samples(path: Path) -> list[tuple[float, float]]:
    """nvidia-smi's ``timestamp, memory.used`` CSV lines (local time, MiB) as (unix time, MiB)."""
    out = []
    for line in path.read_text().splitlines():
        stamp, _, mib = line.rpartition(",")
        if stamp.strip() and mib.strip():
            out.append((datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(mib)))
    return out


def phase_lines(run: Path, gpu_gib: float) -> str:
    """``train 12.3 / 14.0, sync ...``: the device's peak per phase against the estimate's (GiB)."""
    samples, timeline = run / "device_samples.csv", run / "memory_timeline.jsonl"
    if not (samples.is_file() and timeline.is_file()):
        return f"{run.name}: no device samples or memory timeline"
    recs = [json.loads(x) for x in timeline.read_text().splitlines() if x.strip()]
    measured = phase_device_peaks(recs, device_samples(samples))
    est = estimate(load_config(run / "config.yaml"), gpu_gib)
    cells = [
        f"{p} {measured[p]:.1f} / {phase_peak_gib(est, p):.1f}" if p in measured else f"{p} n/a"
        for p in SPANS_OF_PHASE
    ]
    return f"{run.name}: device peak / estimate per phase (GiB): {', '.join(cells)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--prompt-tokens", type=float, default=6.0, help="mean prompt length (char tasks: ~6)")
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS)
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="this GPU's memory, for the estimate")
    a = ap.parse_args()
    summaries, table = {}, [list(COLUMNS)]
    for run in a.run_dirs:
        summaries[run.name], cells = row(run, a.prompt_tokens, a.peak_tflops, a.gpu_gib)
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    for r in table:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    for run in a.run_dirs:
        print(phase_lines(run, a.gpu_gib))
    for name, s in summaries.items():
        if name.endswith("_r3") and name[:-3] + "_off" in summaries:
            off = summaries[name[:-3] + "_off"]
            print(f"{name[:-3]}: step time r3/off {s['step_s'] / off['step_s']:.3f}")
    flat = [
        n for n, s in summaries.items() if n.startswith("tiny_") and not s["reward_last"] > s["reward_first"]
    ]
    if flat:
        print(f"reward did not rise in: {', '.join(flat)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
