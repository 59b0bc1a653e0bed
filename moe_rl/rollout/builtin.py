"""The built-in rollout engine: batched autoregressive sampling with a KV cache and route capture.

Implements :class:`moe_rl.rollout.base.RolloutEngine` on CPU (and small models on GPU) over
:class:`moe_rl.rollout.builtin_model.BuiltinMoEModel`. What it owns:

- the request -> internal batch layout: each distinct prompt is prefilled once (left-padded to
  the longest prompt) and its KV cache fanned out to its n samples, then all B = len(prompts) * n
  sequences decode one token per step in lockstep;
- sampling (temperature, top-k, top-p, stop tokens, max_new_tokens) from a local generator, so a
  seed fixes the whole batch and global RNG is never touched;
- the output layout of ``moe_rl/types.py`` (prompt + response left-aligned, right-padded) and the
  route record of every sample (docs/design.md 5), mirroring vLLM's
  ``routed_experts`` (docs/gpu_stack.md 1.2): [T_b - 1, L_moe, K], prompt rows included, the
  last sampled token has no row, ids in torch.topk order, uint8 (uint16 for E > 255).

In-flight weight updates (docs/design.md 15.1): ``generate(..., updates=source)`` polls the source
once before each forward pass (poll i precedes forward i; forward 0 is the prefill, forward i >= 1
feeds generated token i - 1 and yields generated token i's logits) and applies an update whole
between two forwards. Generated token i's log-prob and the route row of its input (slot P - 1 + i)
come from forward i, and ``version_BS`` records that forward's weight version. On an update the KV
cache is kept (``inflight_kv="keep"``: earlier slots keep the old weights' keys/values) or rebuilt
by re-prefilling the whole prefix under the new weights (``"recompute"``); the re-prefill's routes of
already-sampled tokens are discarded, never written over the rows that produced their log-probs.

Log-probs: the reported log-prob of a token is always log softmax(logits / temperature) over the
full vocabulary (``logprob_support = "full"``), computed in fp32 from the engine's logits. top-k and
top-p only shape the distribution that is *sampled from*; they never renormalise the reported
log-prob. This matches what the learner recomputes (full softmax at the same temperature), so the
importance ratio measures engine-vs-learner mismatch and nothing else. (vLLM's
``processed_logprobs`` would instead renormalise after top-k/top-p.)

Shape suffixes: B sequences, U distinct prompts, P longest prompt, G generated steps, S padded
sequence length (or KV slots), V vocabulary, L MoE layers, K top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_rl.config import ModelConfig
from moe_rl.errors import RouteError
from moe_rl.rollout.base import EarlyAbort, UpdateSource, Weights
from moe_rl.rollout.builtin_model import DTYPES, BuiltinMoEModel, ForwardOut, KVCache, RouterNoise
from moe_rl.rollout.fp8 import QUANTIZATIONS, SCOPES
from moe_rl.rollout.token_sampling import sample_next
from moe_rl.routing.provenance import COMPUTED, REPREFILL, Provenance
from moe_rl.routing.record import route_dtype
from moe_rl.types import RolloutBatch, SamplingParams

_NOISE_SEED_MUL = 6364136223846793005  # decorrelates the router-noise stream from sampling
_NOISE_SEED_ADD = 1442695040888963407
INFLIGHT_KV = ("keep", "recompute")  # rollout.inflight_kv: the KV cache on an in-flight update


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------


def _to_route_dtype(
    routes_BSLK: torch.Tensor, shift_B: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype
) -> torch.Tensor:
    """The engine's int32 expert ids in the record dtype; an id outside [0, E) is a RouteError
    naming sample, layer and row (token position) and the value, never wrapped by the cast."""
    bad_BSLK = (routes_BSLK < 0) | (routes_BSLK >= cfg.num_experts)
    if bool(bad_BSLK.any()):
        b, s, li, k = (int(x) for x in bad_BSLK.nonzero()[0])
        raise RouteError(
            f"sample {b}, layer {cfg.moe_layers[li]}, row {s - int(shift_B[b])}: built-in engine "
            f"expert id {int(routes_BSLK[b, s, li, k])} outside [0, {cfg.num_experts})"
        )
    return routes_BSLK.to(dtype)


def _tail_rows(B: int, frac: float, seed: int, device: torch.device) -> torch.Tensor:
    """bool [B]: the rows that ignore the stop tokens (``rollout.long_tail_frac``, a lab/bench
    instrument): ceil(frac * B) of them, picked by ``seed`` from a generator of their own, so the
    sampling stream is the same as without them."""
    tail_B = torch.zeros(B, dtype=torch.bool, device=device)
    k = math.ceil(frac * B)
    if k:
        pick = torch.Generator().manual_seed((seed * _NOISE_SEED_ADD + _NOISE_SEED_MUL) % 2**64)
        tail_B[torch.randperm(B, generator=pick, device="cpu")[:k].to(device)] = True
    return tail_B


@dataclass
class _Rollout:
    """Internal state of one generate call. Slot j of a row = KV-cache / internal position j:
    the prompt sits right-aligned in slots [P - prompt_len, P), generated token g in slot P + g."""

    prompt_BP: torch.Tensor  # int64, left-padded prompts (already fanned out to B rows)
    prompt_valid_BP: torch.Tensor  # bool
    prompt_lens_B: torch.Tensor  # int64
    prompt_positions_BP: torch.Tensor  # int64 RoPE positions of the prompt slots (re-prefill)
    cache: KVCache
    routes_BSLK: torch.Tensor  # int32, row j = ids computed when slot j was the input
    route_version_BS: torch.Tensor  # int32, the weight version of the forward that computed row j
    route_source_BS: torch.Tensor  # uint8, COMPUTED, or REPREFILL for a re-prefill's row
    logits_BV: torch.Tensor  # fp32, next-token logits
    logits_version: int  # the weight version of the forward that computed logits_BV
    gen_tokens_BG: torch.Tensor  # int64
    gen_logprobs_BG: torch.Tensor  # fp32
    gen_version_BG: torch.Tensor  # int32, weight version of the forward behind each log-prob (0: none)
    gen_valid_BG: torch.Tensor  # bool, true on emitted tokens (a prefix of each row)
    finished_B: torch.Tensor  # bool, emitted a stop token
    num_steps: int = 0
    gen_dist_BGV: torch.Tensor | None = None  # fp32 full log-probs per step (return_dist)
    gen_safe_BGV: torch.Tensor | None = None  # bool DVP safe set per step
    tail_B: torch.Tensor | None = None  # bool, rows that ignore the stop tokens (long_tail_frac)


class BuiltinEngine:
    """The CPU rollout engine (see module docstring). Implements ``RolloutEngine``.

    Args:
        model_cfg: the architecture (``vocab_size`` must be resolved, > 0).
        dtype: "bf16" (default; an inference engine's own numerics) or "fp32".
        pad_id: token written after a sequence ends and fed for finished rows.
        device: torch device of weights, cache and sampling.
        router_logit_noise: std of Gaussian noise added to the fp32 router logits, drawn from
            the call's seed: a dialled-in routing mismatch for experiments; 0 = off.
        inflight_kv: what an in-flight update does to the KV cache: "keep" | "recompute"
            (module docstring; ``rollout.inflight_kv``).
        quantization: "none" | "fp8": blockwise FP8 linear layers, emulated (``rollout.quantization``,
            moe_rl/rollout/fp8.py), weights quantized at every load.
        quantize: with fp8, which linear layers: "all_linear" | "experts" (``rollout.quantize``).
        fp8_granularity, kv_cache_dtype: ``rollout.fp8_granularity`` / ``rollout.kv_cache_dtype``.

    ``version`` is the weight version of the loaded weights: 0 before the first load, then set by
    every load (``load_weights``, or an in-flight update).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        *,
        dtype: str = "bf16",
        pad_id: int,
        device: torch.device | str = "cpu",
        router_logit_noise: float = 0.0,
        inflight_kv: str = "keep",
        quantization: str = "none",
        quantize: str = "all_linear",
        fp8_granularity: str = "block",
        kv_cache_dtype: str = "auto",
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if model_cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be > 0 to build the built-in engine")
        if not 0 <= pad_id < model_cfg.vocab_size:
            raise ValueError(f"pad_id {pad_id} is outside the vocabulary [0, {model_cfg.vocab_size})")
        if router_logit_noise < 0:
            raise ValueError(f"router_logit_noise must be >= 0, got {router_logit_noise}")
        if inflight_kv not in INFLIGHT_KV:
            raise ValueError(f"inflight_kv {inflight_kv!r} is not one of {INFLIGHT_KV}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {quantization!r} is not one of {QUANTIZATIONS}")
        if quantize not in SCOPES:
            raise ValueError(f"quantize {quantize!r} is not one of {SCOPES}")
        self.cfg = model_cfg
        self.pad_id = pad_id
        self.device = torch.device(device)
        self.router_logit_noise = float(router_logit_noise)
        fp8 = quantization == "fp8" and quantize
        self.model = BuiltinMoEModel(
            model_cfg, DTYPES[dtype], self.device, fp8, fp8_granularity, kv_cache_dtype
        )
        self.route_dtype = route_dtype(model_cfg.num_experts)
        self.inflight_kv = inflight_kv
        self.version = 0

    def load_weights(self, weights: Weights, version: int | None = None) -> dict[str, float] | None:
        """Replace all weights in place from a dict or a stream of chunks (one chunk held at a
        time); names/shapes over all chunks must be exactly ``canonical_param_shapes(cfg)``.

        ``version``: the weight version they are (>= 1); default: the current version + 1. It is
        set only once the load completed (a dict is checked whole before any copy). With FP8 it
        returns the sync's ``rollout/fp8_weight_rel_err``: ||fp8(W) - W|| / ||W|| over the
        quantized tensors (W as received); else None."""
        new = self.version + 1 if version is None else int(version)
        if new < 1:
            raise ValueError(f"weight version must be >= 1 (0 marks prompt/pad tokens), got {new}")
        self.model.load_canonical(weights)
        self.version = new
        if not self.model.fp8_names:
            return None
        sq_err, sq = self.model.fp8_err
        return {"rollout/fp8_weight_rel_err": (sq_err / sq) ** 0.5 if sq > 0 else 0.0}

    def held_weights(self) -> dict[str, torch.Tensor]:
        """Every canonical tensor as the engine holds it now (views of its own tensors, experts
        inside their stacks; FP8: the dequantized values): the checked sync's engine side."""
        return dict(self.model._slots)

    @torch.no_grad()
    def token_logprobs(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """fp32 [B, S]: column t the log-prob of token t given tokens < t (column 0: 0), one
        no-cache forward at temperature 1 (the checked sync's probe)."""
        tokens_BS = tokens_BS.to(self.device)
        B, S = tokens_BS.shape
        pos_BS = torch.arange(S, device=self.device).expand(B, S)
        valid_BS = torch.ones((B, S), dtype=torch.bool, device=self.device)
        logp_BSV = self.model.forward(tokens_BS, pos_BS, valid_BS).logits.log_softmax(-1)
        out_BS = torch.zeros((B, S), dtype=torch.float32, device=self.device)
        out_BS[:, 1:] = logp_BSV[:, :-1].gather(-1, tokens_BS[:, 1:, None])[..., 0]
        return out_BS

    @torch.no_grad()
    def prefill_routes(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The route verifier's reference (moe_rl/routing/verify.py): one no-cache forward over each
        whole sequence at the loaded weights (no router noise, no prefix cache), right-padded in one
        batch: (expert ids int64 [B, S, L, K], Top-K margins fp32 [B, S, L]) of every position, on
        the host. Row t is token t's, as in a route record."""
        lens_B = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=self.device)
        S = int(lens_B.max())
        tokens_BS = torch.full((len(seqs), S), self.pad_id, dtype=torch.long, device=self.device)
        for b, s in enumerate(seqs):  # one row copy per sequence
            tokens_BS[b, : len(s)] = torch.tensor(s, dtype=torch.long, device=self.device)
        valid_BS = torch.arange(S, device=self.device)[None, :] < lens_B[:, None]
        pos_BS = torch.arange(S, device=self.device).expand(len(seqs), S)
        out = self.model.forward(tokens_BS, pos_BS, valid_BS, last_logits_only=True, margins=True)
        return out.expert_ids_BTLK.cpu(), out.margin_BTL.cpu()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        seed: int,
        updates: UpdateSource | None = None,
        abort: EarlyAbort | None = None,
    ) -> RolloutBatch:
        """Sample n responses per prompt, all B = len(prompts) * n sequences in one batch.

        Sequence b answers prompt b // n. Deterministic given ``seed`` (local generators only)
        and the polls at which ``updates`` delivers (the update schedule).
        A sequence stops after emitting a stop token (kept, counted in its response length) or
        after ``max_new_tokens``; generation ends early once every sequence has stopped.

        ``updates``: polled once before each forward pass (never after the last one, so an update
        that no forward would use stays with the source); an update is applied whole between two
        forwards (module docstring). None: no polls, the weights stay as loaded.

        ``abort``: per-row token budgets and an early stop checked every ``abort.every`` decode
        steps (``EarlyAbort``; over-sampling, moe_rl.step.oversample.py).
        """
        self._check_request(prompts, n, sampling)
        self._apply_update(updates)
        sample_gen = torch.Generator(device=self.device).manual_seed(seed)
        noise = None
        if self.router_logit_noise > 0:
            noise_seed = (seed * _NOISE_SEED_MUL + _NOISE_SEED_ADD) % 2**64
            noise = RouterNoise(
                self.router_logit_noise, torch.Generator(device=self.device).manual_seed(noise_seed)
            )
        state = self._prefill(prompts, n, sampling.max_new_tokens, noise)
        state.tail_B = _tail_rows(state.finished_B.shape[0], sampling.long_tail_frac, seed, self.device)
        self._decode(state, sampling, sample_gen, noise, updates, abort, n)
        return self._assemble(state, n, sampling)

    def _apply_update(self, updates: UpdateSource | None) -> bool:
        """Poll ``updates`` once; load what it delivers (whole, before the next forward starts)."""
        update = updates.poll() if updates is not None else None
        if update is None:
            return False
        version, weights = update
        if version <= self.version:  # a source replaying or reordering versions is a bug upstream
            raise ValueError(
                f"in-flight update to weight version {version}: the engine is at version "
                f"{self.version} (versions must increase)"
            )
        self.load_weights(weights, version=version)
        return True

    # -- steps ----------------------------------------------------------------------------------
    def _check_request(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> None:
        V = self.cfg.vocab_size
        if not self.model.loaded:
            raise RuntimeError("BuiltinEngine: no weights loaded (call load_weights first)")
        if not prompts or n < 1:
            raise ValueError(f"need at least one prompt and n >= 1 (got {len(prompts)}, n={n})")
        for u, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {u} is empty")
            if min(p) < 0 or max(p) >= V:
                raise ValueError(f"prompt {u} has a token id outside [0, {V})")
        if sampling.max_new_tokens < 1 or sampling.temperature <= 0:
            raise ValueError("sampling needs max_new_tokens >= 1 and temperature > 0")
        if not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
            raise ValueError("sampling needs top_p in (0, 1] and top_k >= 0")
        if any(not 0 <= t < V for t in sampling.stop_token_ids):
            raise ValueError(f"stop_token_ids {sampling.stop_token_ids} outside [0, {V})")

    def _prefill(self, prompts: list[list[int]], n: int, max_new: int, noise: RouterNoise | None) -> _Rollout:
        """Prefill each distinct prompt once (left-padded), then fan cache/logits/routes out n times."""
        U, dev = len(prompts), self.device
        lens_U = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
        P = int(lens_U.max())
        prompt_UP = torch.full((U, P), self.pad_id, dtype=torch.long, device=dev)
        for u, p in enumerate(prompts):  # one row copy per prompt, not per token
            prompt_UP[u, P - len(p) :] = torch.tensor(p, dtype=torch.long, device=dev)
        valid_UP = torch.arange(P, device=dev)[None, :] >= (P - lens_U)[:, None]
        positions_UP = (valid_UP.long().cumsum(1) - 1).clamp(min=0)
        # The last sampled token is never fed back, so P + max_new - 1 slots suffice.
        cache_U = KVCache.allocate(self.cfg, U, P + max_new - 1, self.model.dtype, dev)
        ids_UPLK, logits_UV, ver_UP, src_UP = self._prefill_forward(
            prompts, prompt_UP, positions_UP, valid_UP, cache_U, noise
        )
        B, L, K = U * n, len(self.cfg.moe_layers), self.cfg.moe_router_topk
        routes_BSLK = torch.zeros((B, P + max_new - 1, L, K), dtype=torch.int32, device=dev)
        routes_BSLK[:, :P] = ids_UPLK.repeat_interleave(n, dim=0)
        route_version_BS = torch.full((B, P + max_new - 1), self.version, dtype=torch.int32, device=dev)
        route_source_BS = torch.full_like(route_version_BS, COMPUTED, dtype=torch.uint8)
        if ver_UP is not None:  # a prefix cache's hits keep the version that filled them
            route_version_BS[:, :P] = ver_UP.repeat_interleave(n, dim=0)
            route_source_BS[:, :P] = src_UP.repeat_interleave(n, dim=0)
        return _Rollout(
            prompt_BP=prompt_UP.repeat_interleave(n, dim=0),
            prompt_valid_BP=valid_UP.repeat_interleave(n, dim=0),
            prompt_lens_B=lens_U.repeat_interleave(n),
            prompt_positions_BP=positions_UP.repeat_interleave(n, dim=0),
            cache=cache_U.repeat_rows(n),
            routes_BSLK=routes_BSLK,
            route_version_BS=route_version_BS,
            route_source_BS=route_source_BS,
            logits_BV=logits_UV.repeat_interleave(n, dim=0),
            logits_version=self.version,
            gen_tokens_BG=torch.full((B, max_new), self.pad_id, dtype=torch.long, device=dev),
            gen_logprobs_BG=torch.zeros((B, max_new), dtype=torch.float32, device=dev),
            gen_version_BG=torch.zeros((B, max_new), dtype=torch.int32, device=dev),
            gen_valid_BG=torch.zeros((B, max_new), dtype=torch.bool, device=dev),
            finished_B=torch.zeros(B, dtype=torch.bool, device=dev),
        )

    def _prefill_forward(self, prompts, prompt_UP, positions_UP, valid_UP, cache_U, noise):
        """The prompts' forward into ``cache_U``: (expert ids [U, P, L, K], last logits [U, V], and
        the rows' versions and sources [U, P], None: all computed now). A prefix cache overrides it."""
        out = self.model.forward(
            prompt_UP, positions_UP, valid_UP, cache_U, last_logits_only=True, noise=noise
        )
        return out.expert_ids_BTLK, out.logits[:, -1], None, None

    def _decode(
        self,
        st: _Rollout,
        sampling: SamplingParams,
        gen: torch.Generator,
        noise: RouterNoise | None,
        updates: UpdateSource | None = None,
        abort: EarlyAbort | None = None,
        n: int = 1,
    ) -> None:
        """Sample, record, feed back; one token for every row per step, finished rows feed pad.
        Before each forward, ``updates`` is polled (``_apply_update``). ``abort``: a row stops at its
        budget (``capped_B``), and the loop at the first check ``abort.enough`` accepts."""
        B, P = st.prompt_BP.shape
        max_new = sampling.max_new_tokens
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=self.device)
        key_valid_BS = torch.cat(
            [st.prompt_valid_BP, torch.ones((B, max_new), dtype=torch.bool, device=self.device)], 1
        )
        V = self.cfg.vocab_size
        if sampling.return_dist:
            st.gen_dist_BGV = torch.zeros((B, max_new, V), dtype=torch.float32, device=self.device)
        if sampling.dvp.on:
            st.gen_safe_BGV = torch.zeros((B, max_new, V), dtype=torch.bool, device=self.device)
        capped_B = torch.zeros_like(st.finished_B)  # used its budget (abort.budget_B)
        budget_B = None if abort is None or abort.budget_B is None else abort.budget_B.to(self.device)
        for g in range(max_new):
            tok_B, lp_B, dist_BV, safe_BV = sample_next(
                st.logits_BV,
                sampling.temperature,
                sampling.top_k,
                sampling.top_p,
                gen,
                sampling.dvp,
            )
            if st.gen_dist_BGV is not None:
                st.gen_dist_BGV[:, g] = dist_BV
            if st.gen_safe_BGV is not None:
                st.gen_safe_BGV[:, g] = safe_BV
            active_B = ~st.finished_B & ~capped_B
            st.gen_tokens_BG[:, g] = torch.where(active_B, tok_B, self.pad_id)
            st.gen_logprobs_BG[:, g] = torch.where(active_B, lp_B, 0.0)
            st.gen_version_BG[:, g] = torch.where(active_B, st.logits_version, 0)
            st.gen_valid_BG[:, g] = active_B
            st.finished_B |= active_B & torch.isin(tok_B, stop_ids) & ~st.tail_B
            st.num_steps = g + 1
            if budget_B is not None:
                capped_B |= active_B & (g + 1 >= budget_B)
            if g == max_new - 1 or bool((st.finished_B | capped_B).all()):
                break
            if abort is not None and (g + 1) % abort.every == 0:  # one host sync per check; the
                # peek never fills a prefix cache (its blocks are stored from the returned batch)
                if abort.enough(
                    st.finished_B | capped_B, lambda: BuiltinEngine._assemble(self, st, n, sampling)
                ):
                    break
            slot = P + g
            if self._apply_update(updates) and self.inflight_kv == "recompute":
                out = self._reprefill(st, g, key_valid_BS[:, : slot + 1], noise)
                st.route_source_BS[:, slot] = REPREFILL
            else:
                out = self.model.forward(
                    st.gen_tokens_BG[:, g : g + 1],
                    (st.prompt_lens_B + g)[:, None],
                    key_valid_BS[:, : slot + 1],
                    st.cache,
                    noise=noise,
                )
            # Only the row of the token fed now: the re-prefill's rows of earlier slots are dropped,
            # so each earlier row stays from the forward that produced the next token's log-prob.
            st.routes_BSLK[:, slot] = out.expert_ids_BTLK[:, -1]
            st.route_version_BS[:, slot] = self.version
            st.logits_BV = out.logits[:, -1]
            st.logits_version = self.version

    def _reprefill(
        self, st: _Rollout, g: int, key_valid_BS: torch.Tensor, noise: RouterNoise | None
    ) -> ForwardOut:
        """Rebuild the whole KV cache under the current weights: one forward over every slot up to
        and including generated token g (the one the decode step would feed), all rows at once."""
        tokens_BS = torch.cat([st.prompt_BP, st.gen_tokens_BG[:, : g + 1]], 1)
        gen_positions_BG = st.prompt_lens_B[:, None] + torch.arange(g + 1, device=self.device)
        positions_BS = torch.cat([st.prompt_positions_BP, gen_positions_BG], 1)
        st.cache.length = 0  # overwritten from slot 0
        return self.model.forward(
            tokens_BS, positions_BS, key_valid_BS, st.cache, last_logits_only=True, noise=noise
        )

    def _per_position(
        self, gen_BGV: torch.Tensor | None, src_BS: torch.Tensor, P: int, response_mask_BS: torch.Tensor
    ) -> torch.Tensor | None:
        """A per-generated-token [B, G, V] tensor in the output layout [B, S, V] (0 elsewhere)."""
        if gen_BGV is None:
            return None
        G, V = gen_BGV.shape[1], gen_BGV.shape[2]
        g_BS = (src_BS - P).clamp(0, G - 1)
        out_BSV = gen_BGV.gather(1, g_BS[..., None].expand(-1, -1, V))
        return (
            out_BSV * response_mask_BS[..., None].to(out_BSV.dtype)
            if out_BSV.is_floating_point()
            else out_BSV & response_mask_BS[..., None]
        )

    def _assemble(self, st: _Rollout, n: int, sampling: SamplingParams) -> RolloutBatch:
        """Internal left-padded slots -> the right-padded layout of types.py, plus route records."""
        B, P = st.prompt_BP.shape
        G = st.num_steps
        response_lens_B = st.gen_valid_BG[:, :G].sum(1)
        total_B = st.prompt_lens_B + response_lens_B
        S = int(total_B.max())
        tokens_int = torch.cat([st.prompt_BP, st.gen_tokens_BG[:, :G]], 1)
        logprobs_int = torch.cat(
            [torch.zeros_like(st.prompt_BP, dtype=torch.float32), st.gen_logprobs_BG[:, :G]], 1
        )
        versions_int = torch.cat(
            [torch.zeros_like(st.prompt_BP, dtype=torch.int32), st.gen_version_BG[:, :G]], 1
        )
        shift_B = P - st.prompt_lens_B  # output position s <- internal slot s + shift
        s_S = torch.arange(S, device=self.device)
        src_BS = (s_S[None, :] + shift_B[:, None]).clamp(max=P + G - 1)
        in_seq_BS = s_S[None, :] < total_B[:, None]
        response_mask_BS = in_seq_BS & (s_S[None, :] >= st.prompt_lens_B[:, None])
        tokens_BS = torch.where(in_seq_BS, tokens_int.gather(1, src_BS), self.pad_id)
        logprobs_BS = torch.where(response_mask_BS, logprobs_int.gather(1, src_BS), 0.0)
        version_BS = torch.where(response_mask_BS, versions_int.gather(1, src_BS), 0)
        routes_all = _to_route_dtype(st.routes_BSLK, shift_B, self.cfg, self.route_dtype)
        starts, totals = shift_B.tolist(), total_B.tolist()
        routes = [routes_all[b, starts[b] : starts[b] + totals[b] - 1].clone() for b in range(B)]
        ver_BS, how_BS = st.route_version_BS.cpu(), st.route_source_BS.cpu()
        prov = [  # turn 0: the agent loop stamps its turn on the rows it keeps
            Provenance(
                ver_BS[b, a : a + t - 1].clone(),
                how_BS[b, a : a + t - 1].clone(),
                torch.zeros(t - 1, dtype=torch.int16, device="cpu"),
            )
            for b, (a, t) in enumerate(zip(starts, totals))
        ]
        return RolloutBatch(
            tokens_BS=tokens_BS,
            prompt_lens_B=st.prompt_lens_B.clone(),
            response_lens_B=response_lens_B,
            response_mask_BS=response_mask_BS,
            logprobs_BS=logprobs_BS.float(),
            routes=routes,
            route_prov=prov,
            version_BS=version_BS.to(torch.int32),
            group_B=torch.arange(B, device=self.device) // n,
            finished_B=st.finished_B.clone(),
            logprob_support=sampling.logprob_support,
            dist_logp_BSV=self._per_position(st.gen_dist_BGV, src_BS, P, response_mask_BS),
            safe_BSV=self._per_position(st.gen_safe_BGV, src_BS, P, response_mask_BS),
        )
