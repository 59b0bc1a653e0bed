"""Canonical weights: every tensor name of a model, its shape, and the strict checks of ingest.

Canonical names are the Hugging Face Qwen3-MoE hub names (``model.layers.3.mlp.experts.5.up_proj.
weight``) with every expert listed one by one. The learner exports exactly the dict of
:func:`canonical_param_shapes`; the engines, the HF file format and the warm start check what
they are given against it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moe_rl.config import ModelConfig


def canonical_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical (HF Qwen3-MoE) tensor name of the model and its shape.

    Experts are listed one by one (``mlp.experts.{e}.{gate,up,down}_proj.weight``), the hub
    layout that ``save_pretrained`` writes; ``q_norm``/``k_norm`` only when ``cfg.qk_layernorm``.
    """
    if cfg.vocab_size <= 0:
        raise ValueError("model.vocab_size must be > 0 to lay out weights (0 = not resolved yet)")
    H, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    q_out, kv_out = cfg.num_attention_heads * D, cfg.num_query_groups * D
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, H)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, H)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, q_out)
        if cfg.qk_layernorm:
            shapes[p + "self_attn.q_norm.weight"] = (D,)
            shapes[p + "self_attn.k_norm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if i < cfg.first_k_dense:
            Fd = cfg.ffn_hidden_size
            shapes[p + "mlp.gate_proj.weight"] = (Fd, H)
            shapes[p + "mlp.up_proj.weight"] = (Fd, H)
            shapes[p + "mlp.down_proj.weight"] = (H, Fd)
        else:
            Fm = cfg.moe_ffn_hidden_size
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, H)
            for e in range(cfg.num_experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (Fm, H)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (Fm, H)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (H, Fm)
    shapes["model.norm.weight"] = (H,)
    shapes["lm_head.weight"] = (V, H)
    return shapes


def check_canonical_weights(named: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Raise ValueError naming the first missing, unexpected or mis-shaped tensor (strict ingest)."""
    expected = canonical_param_shapes(cfg)
    missing = [k for k in expected if k not in named]
    if missing:
        raise ValueError(
            f"load_weights: missing tensor {missing[0]!r} ({len(missing)} missing in all: {missing[:5]})"
        )
    check = CanonicalCheck(cfg, expected)
    check.chunk(named)
    check.finish()


class CanonicalCheck:
    """Strict ingest of canonical weights that arrive in chunks: every expected tensor exactly
    once over all chunks, with its shape and a floating point dtype; errors name the tensor."""

    def __init__(self, cfg: ModelConfig, expected: dict[str, tuple[int, ...]] | None = None) -> None:
        self.expected = canonical_param_shapes(cfg) if expected is None else expected
        self.seen: set[str] = set()

    def chunk(self, named: Mapping[str, torch.Tensor]) -> None:
        """Check one chunk before anything of it is used."""
        unexpected = [k for k in named if k not in self.expected]
        if unexpected:
            raise ValueError(
                f"load_weights: unexpected tensor {unexpected[0]!r} "
                f"({len(unexpected)} unexpected in all: {unexpected[:5]})"
            )
        again = [k for k in named if k in self.seen]
        if again:
            raise ValueError(f"load_weights: tensor {again[0]!r} given twice ({len(again)} in all)")
        for name, t in named.items():
            got, shape = tuple(t.shape), self.expected[name]
            if got != shape:
                raise ValueError(f"load_weights: tensor {name!r} has shape {got}, expected {shape}")
            if not t.is_floating_point():
                raise ValueError(
                    f"load_weights: tensor {name!r} has dtype {t.dtype}, expected a floating point dtype"
                )
        self.seen.update(named)

    def finish(self) -> None:
        """After the last chunk: nothing expected is missing."""
        missing = [k for k in self.expected if k not in self.seen]
        if missing:
            raise ValueError(
                f"load_weights: missing tensor {missing[0]!r} ({len(missing)} missing in all: {missing[:5]})"
            )


def random_canonical_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 canonical weights with O(1) activations and logits (tests, random init).

    Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1^2) so
    that a norm that is not applied (or applied in the wrong place) shows up in parity tests.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in canonical_param_shapes(cfg).items():
        if name.endswith("norm.weight"):  # all RMSNorm weights, incl. q_norm / k_norm
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            out[name] = torch.randn(shape, generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen) * shape[1] ** -0.5
    return out
