"""What one rollout-engine rank holds of the canonical weights, and so what the weight sync sends it.

An engine is ``engine_tp(cfg)`` consecutive ranks (vLLM's ``rollout.vllm.tensor_parallel``; the
built-in engine is one rank holding everything); engine rank ``r`` (a learner world rank when
colocated, a rollout rank's index among the rollout ranks when split) is TP rank ``r % tp`` of its
engine. moe-rl configures no expert parallelism inside vLLM, so ``EngineShard.ep_size`` is 1 from
the config; the slicing takes an EP layout too (an engine rank then holds whole experts
[ep_rank x E / EP, (ep_rank + 1) x E / EP)), for when one is configured.

The slices follow vLLM's own loaders, so a TP rank's slice is the rows or columns its
``weight_loader`` would narrow the full tensor to:

- column-parallel (dim 0, equal pieces): q/k/v projections and their biases, MLA's ``q_b_proj``
  and ``kv_b_proj``, dense and shared-expert ``gate_proj`` / ``up_proj``, each expert's
  ``gate_proj`` / ``up_proj``; k/v with fewer KV heads than TP ranks: KV head ``r // (TP / KV)``
  (vLLM replicates KV heads then);
- row-parallel (dim 1, equal pieces): ``o_proj``, ``down_proj`` (dense, shared, each expert);
- vocab-parallel (dim 0): ``embed_tokens`` and ``lm_head``, rows [r x P, (r + 1) x P) of the
  vocabulary padded to a multiple of 64 (P = padded / TP), clipped to the real vocabulary;
- whole on every rank: norms, the router and its expert bias, ``shared_expert_gate``, MLA's
  ``q_a_proj`` and ``kv_a_proj_with_mqa``.

``sync_receive_bytes(cfg, engine_rank)`` is the bytes one engine rank receives per sync: its
slices in their wire dtypes (the engine's dtype, never wider than the learner's; weights/
broadcast.py's ``wire_dtype``). A pure function of the config: the estimate imports it. The
split sync sends each rollout rank these slices; colocated, ``slice_stream.py`` gathers each
learner rank its own engine rank's (in the learner's dtype). Matching vLLM's loaders is by
reading them, untested on GPU; the CPU tests check the slices and the counted bytes against this
module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moe_rl.config import ModelConfig, RunConfig
from moe_rl.rollout.base import ENGINE_DTYPES, engine_dtype
from moe_rl.weights.canonical import canonical_param_shapes

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
_WHOLE = (
    "norm.weight",
    "layernorm.weight",
    "mlp.gate.weight",
    "e_score_correction_bias",
    "shared_expert_gate.weight",
    "q_a_proj.weight",
    "kv_a_proj_with_mqa.weight",
)
_ROW = ("o_proj.weight", "down_proj.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_KV = ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias")


@dataclass(frozen=True)
class EngineShard:
    """One engine rank's place in its engine: TP rank of TP, EP rank of EP (1: every expert)."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def whole(self) -> bool:
        """The rank holds every canonical tensor whole (the built-in engine, vLLM TP 1)."""
        return self.tp_size == 1 and self.ep_size == 1


def engine_shard(cfg: RunConfig, engine_rank: int) -> EngineShard:
    """The shard of engine rank ``engine_rank`` under ``cfg`` (see the module docstring)."""
    tp = cfg.rollout.vllm.tensor_parallel if cfg.rollout.engine == "vllm" else 1
    return EngineShard(tp_size=tp, tp_rank=engine_rank % tp)


def expert_id(name: str) -> int | None:
    """The expert of a routed expert's canonical tensor (``...mlp.experts.<e>.<proj>``), else None."""
    if ".mlp.experts." not in name:
        return None
    return int(name.split(".mlp.experts.")[1].split(".")[0])


def _equal(size: int, rank: int, parts: int, name: str) -> tuple[int, int]:
    if size % parts:
        raise ValueError(
            f"engine slice: {name!r} of {size} along its TP dim does not split over {parts} ranks"
        )
    step = size // parts
    return rank * step, (rank + 1) * step


def slice_bounds(
    name: str, shape: tuple[int, ...], shard: EngineShard, model: ModelConfig
) -> tuple[int, int, int] | None:
    """(dim, start, stop) of what ``shard`` holds of canonical tensor ``name`` of ``shape``; None:
    all of it. Raises KeyError for an expert the shard does not hold (``held``)."""
    e = expert_id(name)
    if e is not None and shard.ep_size > 1:
        return None  # EP engines hold their experts whole (held() says which)
    if shard.tp_size == 1 or name.endswith(_WHOLE):
        return None
    tp, r = shard.tp_size, shard.tp_rank
    if name in _VOCAB:
        padded = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING
        per = padded // tp
        return 0, min(r * per, shape[0]), min((r + 1) * per, shape[0])
    if name.endswith(_KV) and model.num_query_groups < tp:
        if tp % model.num_query_groups:
            raise ValueError(f"engine slice: {model.num_query_groups} KV heads do not replicate over TP {tp}")
        head = r // (tp // model.num_query_groups)
        rows = shape[0] // model.num_query_groups
        return 0, head * rows, (head + 1) * rows
    dim = 1 if name.endswith(_ROW) else 0
    return (dim, *_equal(shape[dim], r, tp, name))


def held(name: str, shard: EngineShard, num_experts: int) -> bool:
    """Whether the shard holds any of canonical tensor ``name`` (an EP engine: its experts only)."""
    e = expert_id(name)
    if e is None or shard.ep_size == 1:
        return True
    per = num_experts // shard.ep_size
    return shard.ep_rank * per <= e < (shard.ep_rank + 1) * per


def engine_slice(
    chunk: Mapping[str, torch.Tensor], shard: EngineShard, model: ModelConfig
) -> dict[str, torch.Tensor]:
    """The part of a canonical chunk that ``shard`` holds: views (``narrow``), no copy; tensors it
    does not hold left out."""
    if shard.whole:
        return dict(chunk)
    out = {}
    for name, t in chunk.items():
        if not held(name, shard, model.num_experts):
            continue
        b = slice_bounds(name, tuple(t.shape), shard, model)
        out[name] = t if b is None else t.narrow(b[0], b[1], b[2] - b[1])
    return out


def sliced_shape(
    name: str, shape: tuple[int, ...], shard: EngineShard, model: ModelConfig
) -> tuple[int, ...]:
    b = slice_bounds(name, shape, shard, model)
    if b is None:
        return shape
    dims = list(shape)
    dims[b[0]] = b[2] - b[1]
    return tuple(dims)


def learner_dtype(name: str, model: ModelConfig) -> torch.dtype:
    """The dtype the learner's canonical stream yields ``name`` in: the parameters' (bf16 under
    model.precision bf16 or fp8, else fp32); the routers' expert bias is an fp32 buffer."""
    if name.endswith("e_score_correction_bias") or model.precision == "fp32":
        return torch.float32
    return torch.bfloat16


def sync_receive_bytes(cfg: RunConfig, engine_rank: int) -> int:
    """Bytes engine rank ``engine_rank`` receives in one weight sync: each canonical tensor it
    holds, sliced to its shard, in the wire dtype (the engine's, ``rollout.dtype``, never wider
    than the learner's). ``cfg.model.vocab_size`` must be resolved (non-zero)."""
    shard, engine = engine_shard(cfg, engine_rank), ENGINE_DTYPES[cfg.rollout.dtype]
    total = 0
    for name, shape in canonical_param_shapes(cfg.model).items():
        if not held(name, shard, cfg.model.num_experts):
            continue
        numel = 1
        for d in sliced_shape(name, tuple(shape), shard, cfg.model):
            numel *= d
        learner = learner_dtype(name, cfg.model)
        wire = min(engine_dtype(name, engine).itemsize, learner.itemsize)
        total += numel * wire
    return total


def placed(
    chunk: Mapping[str, torch.Tensor], shard: EngineShard, model: ModelConfig
) -> dict[str, torch.Tensor]:
    """Received slices in the form an engine that slices full tensors itself takes (vLLM's
    ``weight_loader`` narrows each to its TP rank): each sliced tensor inside a zero tensor of its
    full canonical shape, at its bounds, so the engine reads exactly the bytes that came. A whole
    tensor is passed as it is. The wire carried the slice; the receiver's host buffer is a whole
    chunk's, as before slicing (a loader that takes slices would save it: untested on GPU)."""
    if shard.whole:
        return dict(chunk)
    shapes = canonical_param_shapes(model)
    out = {}
    for name, t in chunk.items():
        full = tuple(shapes[name])
        b = slice_bounds(name, full, shard, model)
        if b is None:
            out[name] = t
            continue
        whole = t.new_zeros(full)
        whole.narrow(b[0], b[1], b[2] - b[1]).copy_(t)
        out[name] = whole
    return out
