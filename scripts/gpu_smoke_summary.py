"""Print step time, tokens/s, MFU and routing agreement of a run: python scripts/gpu_smoke_summary.py RUN_DIR.

Thin wrapper: the arithmetic is moe_rl.memory.summarize_run (unit-tested on CPU)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_rl.config import load_config
from moe_rl.memory import H100_BF16_DENSE_TFLOPS, summarize_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--label", default="")
    ap.add_argument("--prompt-tokens", type=float, default=6.0, help="mean prompt length (char tasks: ~6)")
    ap.add_argument("--num-gpus", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS)
    a = ap.parse_args()
    run = Path(a.run_dir)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    s = summarize_run(rows, load_config(run / "config.yaml"), prompt_tokens=a.prompt_tokens,
                      num_gpus=a.num_gpus, peak_tflops=a.peak_tflops)
    agree = f"{s['routing_agreement']:.4f}" if "routing_agreement" in s else "n/a"
    print(f"[{a.label or run.name}] steps={s['steps']:.0f} step_s={s['step_s']:.3f} "
          f"tokens/s={s['tokens_per_s']:,.0f} MFU={100 * s['mfu']:.3f}% routing_agreement={agree} "
          f"k3_kl={s.get('corr/k3_kl', float('nan')):.2e} reward={s.get('reward/mean', float('nan')):.3f}")


if __name__ == "__main__":
    main()
