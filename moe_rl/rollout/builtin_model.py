"""The built-in rollout engine's own model: a Qwen3-MoE-style decoder in plain PyTorch, with a KV cache.

This module owns the engine's numeric path (not megatron's): weights and activations in the
engine dtype (bf16 by default, fp32 as an option), RMSNorm and RoPE (``builtin_rope.py``) computed
in fp32 then cast, router logits in fp32, and a sort-by-expert MoE that runs each expert once on
its slice of tokens.
The architecture matches megatron-core's GPTModel with the local spec (and HF transformers'
``Qwen3MoeForCausalLM``) exactly in fp32; in bf16 it differs the way a real inference engine does,
so the training-inference mismatch that rollout correction handles is real on a laptop.

Every forward records the Top-K expert ids of every MoE layer for every processed token: the raw
material of the route record (docs/design.md 5; vLLM's ``routed_experts``, docs/gpu_stack.md 1.2).

Weights come in the canonical (HF Qwen3-MoE hub) names listed by ``canonical_param_shapes``
(moe_rl/weights/canonical.py); the learner exports exactly that dict with all experts gathered.

Shape suffix legend:
    B sequences, T query tokens of one forward call, S key positions (KV cache slots),
    H hidden size, N attention heads, G key/value groups, D head dim, F FFN hidden size,
    E experts, K router top-k, L MoE layers, V vocabulary, P routed (token, expert) pairs (T*K).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moe_rl.config import ModelConfig
from moe_rl.rollout.base import ENGINE_DTYPES, Weights, engine_dtype, weight_chunks
from moe_rl.rollout.builtin_rope import apply_rope, rope_tables, softmax_scale
from moe_rl.rollout.fp8 import (
    GRANULARITIES,
    KV_CACHE_DTYPES,
    check_quantized_names,
    fake_quant_act,
    fake_quant_act_tensor,
    fake_quant_kv,
    identity,
    is_expert,
    quantize_in_place,
    quantize_tensor_in_place,
    quantized_names,
)
from moe_rl.rollout.kv_cache import KVCache  # noqa: F401 (its home before; importers use both)
from moe_rl.routing.gating import RouterSpec, route, topk_margin
from moe_rl.weights.canonical import CanonicalCheck, canonical_param_shapes, check_canonical_weights

DTYPES = ENGINE_DTYPES
# eps of the q_a / kv_a RMSNorms of MLA: transformers' DeepseekV3RMSNorm default (not rms_norm_eps)
MLA_EPS = 1e-6


# -- forward outputs ---------------------------------------------------------------


class ForwardOut(NamedTuple):
    """logits: fp32 [B, T, V] (or [B, 1, V] with last_logits_only); expert_ids_BTLK: int64;
    margin_BTL: fp32 Top-K margins of the selection scores (``forward(margins=True)``), else None."""

    logits: torch.Tensor
    expert_ids_BTLK: torch.Tensor
    margin_BTL: torch.Tensor | None = None


@dataclass
class RouterNoise:
    """Gaussian noise of std ``std`` added to the fp32 router logits (dialled-in routing mismatch).

    Drawn from ``generator`` so it is deterministic given the engine's seed.
    """

    std: float
    generator: torch.Generator


# -- Numeric building blocks ----------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim, in fp32, cast back to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


Act = Callable[[torch.Tensor], torch.Tensor]  # what a linear layer's input goes through (FP8: fp8.py)


def swiglu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, aq: Act = identity
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); weights [F, H], [F, H], [H, F]; ``aq`` on each matmul's input."""
    xq = aq(x)
    return F.linear(aq(F.silu(F.linear(xq, w_gate)) * F.linear(xq, w_up)), w_down)


@dataclass
class SharedExpert:
    """The shared expert of a MoE layer (DeepSeek/GLM ``shared_experts``, Qwen2-MoE ``shared_expert``):
    a SwiGLU MLP every token goes through; ``gate_1H`` (Qwen2-MoE) scales it by sigmoid(gate . x)."""

    w_gate_FH: torch.Tensor
    w_up_FH: torch.Tensor
    w_down_HF: torch.Tensor
    gate_1H: torch.Tensor | None = None
    aq: Act = identity  # the SwiGLU's activation quantizer; the gate reads x unquantized

    def __call__(self, x_TH: torch.Tensor) -> torch.Tensor:
        y_TH = swiglu(x_TH, self.w_gate_FH, self.w_up_FH, self.w_down_HF, self.aq)
        if self.gate_1H is not None:
            y_TH = torch.sigmoid(F.linear(x_TH, self.gate_1H)) * y_TH
        return y_TH


def moe_forward(
    x_TH: torch.Tensor,
    router_EH: torch.Tensor,
    w_gate_EFH: torch.Tensor,
    w_up_EFH: torch.Tensor,
    w_down_EHF: torch.Tensor,
    top_k: int,
    noise: RouterNoise | None = None,
    *,
    spec: RouterSpec | None = None,
    bias_E: torch.Tensor | None = None,
    shared: SharedExpert | None = None,
    aq: Act = identity,
    margins: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K MoE: route in fp32 (moe_rl/routing/gating.py), run experts on sorted slices.

    ``spec`` is the router (default: Qwen3's softmax with renormalised top-k); ``bias_E`` the
    expert bias (sigmoid scores: selects, never weights); ``shared`` the shared expert, added to
    every token. Tokens are sorted by expert so each expert runs one matmul on its contiguous
    slice; the only Python loop is over the E experts. ``aq``: the experts' activation quantizer
    (the router reads x as it is). ``margins``: a list, gets the tokens' Top-K margins [T] appended.

    Args:
        x_TH: tokens in the engine dtype. router_EH: router weight (kept in fp32).
        w_gate_EFH, w_up_EFH, w_down_EHF: stacked expert weights in the engine dtype.
    Returns:
        y_TH in x's dtype, and ids_TK int64, in descending selection score.
    """
    spec = spec if spec is not None else RouterSpec(top_k)
    num_experts = router_EH.shape[0]
    logits_TE = F.linear(x_TH.float(), router_EH.float())
    if noise is not None and noise.std > 0:
        logits_TE = logits_TE + noise.std * torch.randn(
            logits_TE.shape, generator=noise.generator, device=logits_TE.device
        )
    gates_TK, ids_TK, select_TE = route(logits_TE, spec, bias_E)
    if margins is not None:
        margins.append(topk_margin(select_TE, spec))
    gates_TK = gates_TK.to(x_TH.dtype)

    flat_ids_P = ids_TK.reshape(-1)
    order_P = torch.argsort(flat_ids_P, stable=True)
    token_of_P = order_P // top_k
    counts = torch.bincount(flat_ids_P, minlength=num_experts).tolist()
    # the quantizer sees all routed pairs at once (per-tensor FP8: one scale, as vLLM's fused MoE)
    used = [e for e in range(num_experts) if counts[e] > 0]
    sizes = [counts[e] for e in used]
    x_slices = aq(x_TH[token_of_P]).split(sizes)
    h_PF = torch.cat(
        [F.silu(F.linear(x, w_gate_EFH[e])) * F.linear(x, w_up_EFH[e]) for e, x in zip(used, x_slices)]
    )
    h_slices = aq(h_PF).split(sizes)
    y_PH = torch.cat([F.linear(h, w_down_EHF[e]) for e, h in zip(used, h_slices)])
    y_PH = y_PH * gates_TK.reshape(-1)[order_P, None]
    y_TH = torch.zeros_like(x_TH).index_add_(0, token_of_P, y_PH)
    if shared is not None:
        y_TH = y_TH + shared(x_TH)
    return y_TH, ids_TK


# -- The model --------------------------------------------------------------------------------------


class BuiltinMoEModel:
    """Qwen3-MoE decoder over canonical weights, with an optional KV cache and route capture.

    Not an nn.Module on purpose: it is inference-only, holds no gradients, and its weights are
    overwritten in place by :meth:`load_canonical` on every weight sync.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        fp8: frozenset[str] | bool | str = False,
        fp8_granularity: str = "block",
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``fp8``: True (all_linear) or a scope (``SCOPES``) quantizes the rule's names, a set exactly
        those (refused if it holds a router, gate or expert bias); False: none. ``fp8_granularity``:
        block (128x128 / 1x128) | tensor (vLLM's per-tensor ``fp8``); ``kv_cache_dtype``: auto |
        fp8_e4m3 (keys and values stored in e4m3, fp8.py)."""
        if fp8_granularity not in GRANULARITIES or kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"FP8 granularity / KV cache dtype {fp8_granularity!r} / {kv_cache_dtype!r}")
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be > 0 to build the built-in engine")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        scope = "all_linear" if fp8 is True else fp8 if isinstance(fp8, str) else None
        names = quantized_names(canonical_param_shapes(cfg), scope) if scope else frozenset(fp8 or ())
        check_quantized_names(names)
        self.fp8_names: frozenset[str] = names
        # a matmul reads quantized activations iff its weight is FP8: experts, and everything else
        act = fake_quant_act if fp8_granularity == "block" else fake_quant_act_tensor
        self.aq: Act = act if any(not is_expert(n) for n in names) else identity
        self.aq_experts: Act = act if any(map(is_expert, names)) else identity
        self.per_tensor = fp8_granularity == "tensor"  # weights quantized once the load is whole
        self.kvq: Act = fake_quant_kv if kv_cache_dtype == "fp8_e4m3" else identity
        self.fp8_err = (0.0, 0.0)  # the last load's sum of squared FP8 weight errors, of squared weights
        self.moe_layers: list[int] = cfg.moe_layers
        self.router_spec = RouterSpec.from_model(cfg)
        self.w: dict[str, torch.Tensor] = {}  # canonical name -> tensor (experts stacked, below)
        self._slots: dict[str, torch.Tensor] = {}  # every canonical name -> its place in self.w
        self.loaded = False

    # -- weights ------------------------------------------------------------------------------
    def load_canonical(self, weights: Weights) -> None:
        """Copy canonical weights (a dict, or a stream of chunks consumed one at a time) into
        the engine's own tensors in place, in the engine dtype (the router stays fp32).

        Per MoE layer the experts live stacked in ``mlp.experts.{gate,up,down}_proj`` tensors
        [E, F, H] / [E, F, H] / [E, H, F] so the MoE indexes one tensor per projection. Each
        chunk is checked before it is copied (``CanonicalCheck``); a dict is checked whole
        first, so a bad dict changes nothing. A stream that fails after its first copy leaves
        the engine without usable weights (``loaded`` false) until a complete load.
        """
        if isinstance(weights, Mapping):
            check_canonical_weights(weights, self.cfg)
        check, err = CanonicalCheck(self.cfg), (0.0, 0.0)
        for chunk in weight_chunks(weights):
            check.chunk(chunk)
            if not self.w:
                self._allocate(check.expected)
            self.loaded = False
            names = list(chunk)
            # one vectorized copy per chunk (dtype cast included); no new engine tensors
            torch._foreach_copy_([self._slots[n] for n in names], [chunk[n].detach() for n in names])
            del chunk  # before the stream builds the next one: one chunk alive at a time
            # every sync quantizes what the learner sent (the chunk's FP8 tensors, in place)
            if not self.per_tensor:
                e = quantize_in_place([self._slots[n] for n in names if n in self.fp8_names])
                err = (err[0] + e[0], err[1] + e[1])
        check.finish()
        if self.per_tensor:  # a merged weight's scale needs all its parts (q/k/v may span chunks)
            err = quantize_tensor_in_place({n: self._slots[n] for n in sorted(self.fp8_names)})
        self.fp8_err = err
        self.loaded = True

    def _allocate(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """The engine's weight tensors (experts stacked) and, per canonical name, its slot in them."""
        E = self.cfg.num_experts
        w: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            if ".mlp.experts." not in name:
                # The router (and its expert bias) is tiny and routing is precision-sensitive:
                # kept fp32 (like megatron's moe_router_dtype=fp32); the rest: engine dtype.
                dtype = engine_dtype(name, self.dtype)
                w[name] = torch.empty(shape, dtype=dtype, device=self.device)
        slots = dict(w)
        for i in self.moe_layers:
            p = f"model.layers.{i}.mlp.experts."
            for proj in ("gate_proj", "up_proj", "down_proj"):
                stacked = w[p + proj] = torch.empty(
                    (E, *shapes[f"{p}0.{proj}.weight"]), dtype=self.dtype, device=self.device
                )
                slots.update({f"{p}{e}.{proj}.weight": stacked[e] for e in range(E)})
        self.w, self._slots = w, slots

    # -- forward ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        key_valid_BS: torch.Tensor,
        cache: KVCache | None = None,
        last_logits_only: bool = False,
        noise: RouterNoise | None = None,
        margins: bool = False,
    ) -> ForwardOut:
        """One forward over T new tokens per row; with a cache, appends to it and attends to it.

        Args:
            tokens_BT: int64 token ids. positions_BT: int64 RoPE positions (per row, from 0 at the
                row's first real token).
            key_valid_BS: bool, which key slots are real tokens; S = cache.length + T with a
                cache (slots [0, S) after this call's append), else S = T. Attention is causal
                in slot order and restricted to valid keys (a token always sees itself, so pad
                rows stay finite).
            cache: None for a no-cache forward over the whole sequence. last_logits_only: the
                lm_head on the last position only (prefill). margins: the Top-K margins too.
        Returns: ForwardOut(logits fp32 [B, T or 1, V], expert_ids_BTLK int64 [B, T, L_moe, K]).
        """
        if not self.loaded:
            raise RuntimeError("BuiltinMoEModel: no weights loaded (call load_weights first)")
        cfg = self.cfg
        B, T = tokens_BT.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.capacity:
            raise ValueError(f"KV cache overflow: {start} + {T} > capacity {cache.capacity}")
        mask_B1TS = self._attention_mask(key_valid_BS, start, T)
        cos_BTR, sin_BTR = rope_tables(positions_BT, cfg)
        h_BTH = F.embedding(tokens_BT, self.w["model.embed_tokens.weight"])
        ids_per_layer: list[torch.Tensor] = []
        margin_per_layer: list[torch.Tensor] | None = [] if margins else None
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            x_BTH = rms_norm(h_BTH, self.w[p + "input_layernorm.weight"], cfg.norm_eps)
            # x feeds the attention's input projections only: quantized once for all of them
            h_BTH = h_BTH + self._attention(i, self.aq(x_BTH), cos_BTR, sin_BTR, mask_B1TS, cache, start)
            x_BTH = rms_norm(h_BTH, self.w[p + "post_attention_layernorm.weight"], cfg.norm_eps)
            if i < cfg.first_k_dense:
                y_BTH = swiglu(
                    x_BTH,
                    self.w[p + "mlp.gate_proj.weight"],
                    self.w[p + "mlp.up_proj.weight"],
                    self.w[p + "mlp.down_proj.weight"],
                    self.aq,
                )
            else:
                y_TH, ids_TK = moe_forward(
                    x_BTH.reshape(B * T, -1),
                    self.w[p + "mlp.gate.weight"],
                    self.w[p + "mlp.experts.gate_proj"],
                    self.w[p + "mlp.experts.up_proj"],
                    self.w[p + "mlp.experts.down_proj"],
                    cfg.moe_router_topk,
                    noise,
                    spec=self.router_spec,
                    bias_E=self.w.get(p + "mlp.gate.e_score_correction_bias"),
                    shared=self._shared_expert(p),
                    aq=self.aq_experts,
                    margins=margin_per_layer,
                )
                y_BTH = y_TH.view(B, T, -1)
                ids_per_layer.append(ids_TK.view(B, T, -1))
            h_BTH = h_BTH + y_BTH
        if cache is not None:
            cache.length = start + T
        if last_logits_only:
            h_BTH = h_BTH[:, -1:]
        h_BTH = rms_norm(h_BTH, self.w["model.norm.weight"], cfg.norm_eps)
        # The lm_head runs in the engine dtype (as an inference engine does); sampling is fp32.
        # tied embeddings (model.tie_word_embeddings): the lm_head is the embedding matrix itself
        lm_head_VH = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        logits_BTV = F.linear(h_BTH, lm_head_VH).float()
        margin_BTL = torch.stack(margin_per_layer, 1).view(B, T, -1) if margins else None
        return ForwardOut(logits_BTV, torch.stack(ids_per_layer, dim=2), margin_BTL)

    def _shared_expert(self, p: str) -> SharedExpert | None:
        """Layer prefix ``p``'s shared expert, or None when the model has none."""
        if self.cfg.moe_shared_expert_ffn_hidden_size == 0:
            return None
        s = p + "mlp.shared_experts."
        return SharedExpert(
            self.w[s + "gate_proj.weight"],
            self.w[s + "up_proj.weight"],
            self.w[s + "down_proj.weight"],
            self.w.get(p + "mlp.shared_expert_gate.weight"),
            self.aq,
        )

    def _attention_mask(self, key_valid_BS: torch.Tensor, start: int, T: int) -> torch.Tensor:
        """bool [B, 1, T, S]: slot j is visible to query slot start+i iff j <= start+i and
        (j is a real token or j is the query itself)."""
        S = start + T
        if key_valid_BS.shape[1] != S:
            raise ValueError(f"key_valid_BS covers {key_valid_BS.shape[1]} slots, expected {S}")
        q_slot_T = torch.arange(start, S, device=key_valid_BS.device)
        k_slot_S = torch.arange(S, device=key_valid_BS.device)
        causal_TS = k_slot_S[None, :] <= q_slot_T[:, None]
        self_TS = k_slot_S[None, :] == q_slot_T[:, None]
        return (causal_TS[None] & (key_valid_BS[:, None, :] | self_TS[None]))[:, None]

    def _attention(
        self,
        i: int,
        x_BTH: torch.Tensor,
        cos_BTR: torch.Tensor,
        sin_BTR: torch.Tensor,
        mask_B1TS: torch.Tensor,
        cache: KVCache | None,
        start: int,
    ) -> torch.Tensor:
        """Self-attention of layer i, GQA or MLA; returns [B, T, H].

        GQA: optional q/k/v biases (GLM-4.5, Qwen2-MoE), optional per-head q/k RMSNorm before RoPE
        (Qwen3), RoPE on the first rotary_dim dims of each head (partial for GLM-4.5)."""
        if self.cfg.mla:
            return self._mla(i, x_BTH, cos_BTR, sin_BTR, mask_B1TS, cache, start)
        cfg, p, w = self.cfg, f"model.layers.{i}.self_attn.", self.w
        B, T, _ = x_BTH.shape
        N, G, D = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
        bias = (lambda n: w[p + n + ".bias"]) if cfg.attention_bias else (lambda n: None)
        q_BTND = F.linear(x_BTH, w[p + "q_proj.weight"], bias("q_proj")).view(B, T, N, D)
        k_BTGD = F.linear(x_BTH, w[p + "k_proj.weight"], bias("k_proj")).view(B, T, G, D)
        v_BGTD = F.linear(x_BTH, w[p + "v_proj.weight"], bias("v_proj")).view(B, T, G, D).transpose(1, 2)
        if cfg.qk_layernorm:
            q_BTND = rms_norm(q_BTND, w[p + "q_norm.weight"], cfg.norm_eps)
            k_BTGD = rms_norm(k_BTGD, w[p + "k_norm.weight"], cfg.norm_eps)
        q_BNTD = apply_rope(q_BTND.transpose(1, 2), cos_BTR, sin_BTR)
        # FP8 KV cache: what attention reads is what the cache stores (this call's tokens too)
        k_BGTD = self.kvq(apply_rope(k_BTGD.transpose(1, 2), cos_BTR, sin_BTR))
        v_BGTD = self.kvq(v_BGTD)
        if cache is not None:
            cache.k[i][:, :, start : start + T] = k_BGTD
            cache.v[i][:, :, start : start + T] = v_BGTD
            k_BGSD, v_BGSD = cache.k[i][:, :, : start + T], cache.v[i][:, :, : start + T]
        else:
            k_BGSD, v_BGSD = k_BGTD, v_BGTD
        out_BNTD = F.scaled_dot_product_attention(
            q_BNTD, k_BGSD, v_BGSD, attn_mask=mask_B1TS, enable_gqa=True
        )
        return F.linear(self.aq(out_BNTD.transpose(1, 2).reshape(B, T, N * D)), w[p + "o_proj.weight"])

    def _mla(
        self,
        i: int,
        x_BTH: torch.Tensor,
        cos_BTR: torch.Tensor,
        sin_BTR: torch.Tensor,
        mask_B1TS: torch.Tensor,
        cache: KVCache | None,
        start: int,
    ) -> torch.Tensor:
        """Multi-latent attention of layer i (DeepSeek-V3 / Kimi-K2); returns [B, T, H].

        q = q_b(norm(q_a(x))) (or q_proj(x) with q_lora_rank 0), per head [nope Dn | rope R];
        kv_a(x) = [latent C | shared key R]; the normalised latent (and the roped shared key) is
        what the cache keeps; kv_b(latent) gives per head [k_nope Dn | v Dv]. RoPE is interleaved
        (rope_interleave, the hub checkpoints' layout). C = kv_lora_rank."""
        cfg, p, w = self.cfg, f"model.layers.{i}.self_attn.", self.w
        B, T, _ = x_BTH.shape
        N, Dn, R, Dv, C = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        if cfg.q_lora_rank > 0:
            # transformers' DeepseekV3RMSNorm on q_a / kv_a uses its default eps 1e-6 (config checks norm_eps)
            q_lat = rms_norm(
                F.linear(x_BTH, w[p + "q_a_proj.weight"]), w[p + "q_a_layernorm.weight"], MLA_EPS
            )
            q_BTNQ = F.linear(self.aq(q_lat), w[p + "q_b_proj.weight"]).view(B, T, N, Dn + R)
        else:
            q_BTNQ = F.linear(x_BTH, w[p + "q_proj.weight"]).view(B, T, N, Dn + R)
        q_BNTQ = q_BTNQ.transpose(1, 2)
        q_BNTQ = torch.cat((q_BNTQ[..., :Dn], apply_rope(q_BNTQ[..., Dn:], cos_BTR, sin_BTR, True)), dim=-1)
        kv_BTX = F.linear(x_BTH, w[p + "kv_a_proj_with_mqa.weight"])
        lat_BTC = rms_norm(kv_BTX[..., :C], w[p + "kv_a_layernorm.weight"], MLA_EPS)
        kr_B1TR = apply_rope(kv_BTX[..., None, C:].transpose(1, 2), cos_BTR, sin_BTR, True)
        lat_B1TX = self.kvq(torch.cat((lat_BTC[:, None], kr_B1TR), dim=-1))
        if cache is not None:
            cache.k[i][:, :, start : start + T] = lat_B1TX
            lat_B1SX = cache.k[i][:, :, : start + T]
        else:
            lat_B1SX = lat_B1TX
        S = lat_B1SX.shape[2]
        kv_BSNY = F.linear(self.aq(lat_B1SX[:, 0, :, :C]), w[p + "kv_b_proj.weight"]).view(B, S, N, Dn + Dv)
        kv_BNSY = kv_BSNY.transpose(1, 2)
        k_BNSQ = torch.cat((kv_BNSY[..., :Dn], lat_B1SX[..., C:].expand(B, N, S, R)), dim=-1)
        out_BNTV = F.scaled_dot_product_attention(
            q_BNTQ, k_BNSQ, kv_BNSY[..., Dn:], attn_mask=mask_B1TS, scale=softmax_scale(cfg)
        )
        return F.linear(self.aq(out_BNTV.transpose(1, 2).reshape(B, T, N * Dv)), w[p + "o_proj.weight"])
