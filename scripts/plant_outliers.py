"""Plant real-LLM-like activation outliers in a warm start, computing the same function.

    python scripts/plant_outliers.py --in builtin:warmstart --out WS2 --alpha 1024 --where norm --channels 4

``--where norm``: ``--channels`` hidden channels of every layer's RMSNorm weight times ``--alpha`` and
the same input columns of every linear layer reading that norm times 1/alpha (outlier features,
LLM.int8()/SmoothQuant); ``--where down``: that many intermediate channels of every SwiGLU MLP, up_proj
rows times alpha and down_proj columns times 1/alpha (massive activations in the down_proj input,
Sun et al. 2024). ``--alpha`` is a power of two, so bf16 and fp32 logits stay bit-identical and only
a quantizer (FP8) sees the difference (moe_rl/weights/outliers.py). The output is the same
safetensors warm-start format (``scripts/make_warmstart.py``), with the original's architecture
metadata: a run loads it with ``init_weights=WS2`` and the same ``model.*`` keys
(docs/collapse_lab.md 4, "real-model outliers, planted").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--in",
        dest="src",
        default="builtin:warmstart",
        help="a warm-start file (scripts/make_warmstart.py) or builtin:warmstart",
    )
    ap.add_argument("--out", required=True, help="the planted warm start (.safetensors)")
    ap.add_argument("--alpha", type=float, required=True, help="the outlier factor, a power of two")
    ap.add_argument("--where", choices=("norm", "down"), required=True)
    ap.add_argument("--channels", type=int, default=4, help="how many channels (same indices in every layer)")
    ap.add_argument("--seed", type=int, default=0, help="draws the channels")
    ap.add_argument(
        "--no-measure", action="store_true", help="skip the printed check of logits and activations"
    )
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from safetensors import safe_open

    from moe_rl.config import ModelConfig
    from moe_rl.errors import UserError, one_line
    from moe_rl.tasks.tokenizer import CharTokenizer
    from moe_rl.weights.outliers import plant_outliers
    from moe_rl.weights.warmstart import BUILTIN, builtin_path, open_init_weights, save_init_weights

    def fail(msg: str) -> None:
        sys.stderr.write(f"error: {msg}\n")
        raise SystemExit(2)

    path = builtin_path(BUILTIN) if args.src == BUILTIN else Path(args.src)
    if not path.is_file():
        fail(f"--in {args.src}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        model = ModelConfig(**{k: v for k, v in json.loads(meta["model"]).items() if k in fields})
        tok = CharTokenizer()
        stored = open_init_weights(str(path), model, tok)
        planted, info = plant_outliers(
            stored.read_all(), model, args.alpha, args.where, args.channels, args.seed
        )
    except KeyError:
        fail(f"--in {path}: no 'model' metadata (not a warm start written by scripts/make_warmstart.py)")
    except (UserError, ValueError) as e:
        fail(f"--in {path}: {one_line(e) if isinstance(e, UserError) else e}")
    made = json.loads(meta.get("info", "{}"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_init_weights(args.out, planted, model, tok, {**made, "outliers": info, "planted_from": str(path)})
    print(
        f"wrote {args.out}: {args.where} outliers x{args.alpha:g} in channels {info['channels']} "
        f"({info['scaled_up']} tensors x alpha, {info['scaled_down']} x 1/alpha)"
    )
    if not args.no_measure:
        print("\n".join(measure(stored.read_all(), planted, model, tok, info["channels"])))


# what the fp32 engine's linear layers read, in call order within a layer (no shared expert)
INPUTS = ("attention in", "o_proj in", "experts in", "down_proj in")


def measure(original, planted, model, tok, channels: list[int]) -> list[str]:
    """Lines: are the logits bit-identical (fp32 and bf16 engine), and per linear input, the max over
    layers of max|x| / median|x| (Sun et al.'s measure) and of per-tensor FP8's relative error on
    the channels not planted, original -> planted; on a fixed batch of random tokens."""
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.rollout.fp8 import fake_quant_act_tensor

    toks_BS = torch.randint(3, model.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    B, S = toks_BS.shape

    def run(weights, dtype, record=None):
        eng = BuiltinEngine(model, dtype=dtype, pad_id=tok.pad_id)
        eng.load_weights(weights)
        if record is not None:
            rec = lambda x: (record.append(x.reshape(-1, x.shape[-1])), x)[1]  # noqa: E731
            eng.model.aq = eng.model.aq_experts = rec
        pos_BS, valid_BS = torch.arange(S).expand(B, S), torch.ones(B, S, dtype=torch.bool)
        return eng.model.forward(toks_BS, pos_BS, valid_BS).logits

    same = {d: torch.equal(run(original, d), run(planted, d)) for d in ("fp32", "bf16")}
    lines = [f"logits bit-identical to the original's: fp32 {same['fp32']}, bf16 {same['bf16']}"]
    xs = {}
    for name, w in (("original", original), ("planted", planted)):
        xs[name] = []
        run(w, "fp32", xs[name])
    if len(xs["original"]) != len(INPUTS) * model.num_layers:
        return [*lines, "activations: not measured (a layout with dense or shared-expert MLPs)"]
    lines.append("input: max|x|/median|x|; per-tensor FP8 rel. error, channels not planted (max over layers)")
    for k, what in enumerate(INPUTS):
        cols = []
        for name in ("original", "planted"):
            x_layers = xs[name][k :: len(INPUTS)]
            ratio = max(float(x.abs().max() / x.abs().median()) for x in x_layers)
            err = max(_rest_err(x, fake_quant_act_tensor, channels) for x in x_layers)
            cols.append((ratio, err))
        (r0, e0), (r1, e1) = cols
        lines.append(f"  {what:13s} {r0:9.3g} -> {r1:9.3g}   {e0:.4f} -> {e1:.4f}")
    return lines


def _rest_err(x_TC, quant, channels: list[int]) -> float:
    """Relative error of ``quant`` (over the whole tensor) on the channels not planted."""
    rest = torch.ones(x_TC.shape[1], dtype=torch.bool)
    rest[[c for c in channels if c < len(rest)]] = False
    d = (quant(x_TC) - x_TC)[:, rest]
    return float(d.norm() / x_TC[:, rest].norm())


if __name__ == "__main__":
    main()
