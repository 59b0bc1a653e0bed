"""Router-gradient monitor: gradient blackout and routing stability, per MoE layer, every step.

Top-K routing gives an unselected expert's router logit exactly zero gradient (docs/math.md 7.1): with
the gate renormalised over the selected set and no auxiliary loss, a fraction (E - K) / E of the
router-logit entries gets none, structurally. The monitor measures that and what follows from it,
from the update passes' own forwards and backwards (no extra pass):

- ``observe_forward`` (each update micro-batch, forward only, not on recompute; real tokens only,
  padding rows excluded): the native Top-K -> tokens routed per expert, a histogram of the Top-K
  margin (K-th minus (K+1)-th *selection* score, what megatron's top-k compares: the logits for
  softmax, sigmoid + expert bias for sigmoid routers, within the token's selected groups when
  group-limited; percentiles survive the reduction over micro-batches and ranks), and the
  near-boundary counts (margin under ``near_eps``, and under the bf16 resolution |h_(K)| 2^-8);
- ``observe_shared`` (layers with a shared expert, same passes): per token the shared expert's
  share ||s|| / (||s|| + ||r||) of the MoE output norm (s the shared expert's output, gate
  included; r the routed experts' gated sum);
- ``observe_grad`` (the router logits' gradient, via a tensor hook): among tokens whose router
  got any gradient, the entries with exactly zero gradient, per-token gradient norms, and
  per-expert gradient mass;
- ``finalize`` (once per step, after the caller summed the packed statistics and max-reduced
  the per-layer maxima over data-parallel ranks): per-layer metrics under ``router_grad/``.

The update-induced and rollout-vs-learner flip rates come from the routing-replay controller,
which lays routes out like tokens (moe_rl/routing/replay.py); ``rollout_flip_aliases`` files the
latter under this prefix too, so one prefix holds the whole picture.

Only MoE layers are monitored (``layer_ids``): a dense layer has no router, and no metric.
Pure tensor code; the collectives live with the caller (``Learner``).
Shape suffixes: N tokens, E experts, K top-k, L MoE layers, X statistic rows, W row width, H hidden.
"""

from __future__ import annotations

import math

import torch

from moe_rl.routing.gating import RouterSpec, group_mask

# rows of the packed per-layer statistics [L, NUM_STATS, W]
LOAD, GRAD_MASS, MARGIN_HIST, SCALARS = range(4)
NUM_STATS = 4
# SCALARS row: zero-grad entries, grad entries, margin sum, near eps, near bf16, tokens,
# per-token logit-grad norm sum, tokens with any gradient, shared-expert share sum, tokens it covers
_ZERO, _ENTRIES, _MARGIN, _NEAR, _NEAR_BF16, _TOKENS, _TOK_NORM, _LIVE, _SHARED, _SHARED_TOK = range(10)
NUM_SCALARS = 10
# margin histogram: [0, 1e-6), 64 log-spaced bins up to 1e2, [1e2, inf)
MARGIN_EDGES = torch.logspace(-6, 2, 65, dtype=torch.float64)
NUM_BINS = MARGIN_EDGES.numel() + 1
MARGIN_QUANTILES = (0.01, 0.05, 0.5)
BF16_RESOLUTION = 2.0**-8


def expert_load_LE(stats_LXW: torch.Tensor, num_experts: int) -> torch.Tensor:
    """float64 [L, E]: each routed expert's share of its MoE layer's routed token slots (the native
    Top-K of the update passes, real tokens; a row sums to 1, 1/E each when uniform; zeros for a
    layer that saw no token). The shared expert is not a column: it takes every token (its share of
    the output is ``shared_expert_share``)."""
    load_LE = stats_LXW[:, LOAD, :num_experts]
    return load_LE / load_LE.sum(-1, keepdim=True).clamp(min=1)


def structural_zero_frac(
    num_experts: int, top_k: int, pre_softmax: bool = False, aux_loss: bool = False
) -> float:
    """Expected exact-zero fraction of router-logit gradients.

    Gating renormalised over the selected set (softmax over the top-k logits; sigmoid scores
    with top-k; softmax over all then renormalised) leaves unselected logits out of the output:
    (E - K) / E. Softmax over all experts *without* renormalisation (megatron's
    ``moe_router_pre_softmax``) keeps them in the denominator, and a load-balancing loss reads
    every probability: then every entry gets a gradient."""
    return 0.0 if pre_softmax or aux_loss else (num_experts - top_k) / num_experts


def histogram_quantiles(hist_B: torch.Tensor, edges: torch.Tensor, qs: tuple[float, ...]) -> list[float]:
    """Quantiles from a histogram whose bins are [0, e0), [e0, e1), ..., [e_last, inf):
    geometric interpolation inside a log bin (linear in the first); NaN when empty."""
    total = float(hist_B.sum())
    if total == 0:
        return [float("nan")] * len(qs)
    cdf_B = torch.cumsum(hist_B.double(), 0)
    lo_B = torch.cat([edges.new_zeros(1), edges])
    hi_B = torch.cat([edges, edges[-1:]])  # the overflow bin reports its lower edge
    out = []
    for q in qs:
        b = int(torch.searchsorted(cdf_B, cdf_B.new_tensor([q * total])).clamp(max=len(hist_B) - 1))
        below = float(cdf_B[b - 1]) if b > 0 else 0.0
        frac = (q * total - below) / max(float(hist_B[b]), 1.0)
        lo, hi = float(lo_B[b]), float(hi_B[b])
        out.append(lo + frac * (hi - lo) if b == 0 or b == len(hist_B) - 1 else lo * (hi / lo) ** frac)
    return out


class RouterGradMonitor:
    def __init__(
        self,
        layer_ids: list[int],
        num_experts: int,
        top_k: int,
        near_eps: float = 0.1,
        pre_softmax: bool = False,
        aux_loss: bool = False,
        device: torch.device | str = "cpu",
        spec: RouterSpec | None = None,
        shared_expert: bool = False,
    ) -> None:
        """``layer_ids``: the MoE layers (global numbers; dense layers have no router);
        ``device``: where the routers run (the statistics accumulate there: no host sync per layer);
        ``spec``: the router (its groups restrict the margin to the selected groups);
        ``shared_expert``: the MoE layers have one (its output share is reported)."""
        self.layer_ids, self.E, self.K, self.near_eps = list(layer_ids), num_experts, top_k, near_eps
        self.spec = spec if spec is not None else RouterSpec(top_k)
        if self.spec.top_k != top_k:
            raise ValueError(f"router monitor: spec top_k {self.spec.top_k} != top_k {top_k}")
        self.shared_expert = shared_expert
        self.expected_zero_frac = structural_zero_frac(num_experts, top_k, pre_softmax, aux_loss)
        width = max(num_experts, NUM_SCALARS, NUM_BINS)
        self.stats_LXW = torch.zeros(len(layer_ids), NUM_STATS, width, dtype=torch.float64, device=device)
        self.max_L = torch.zeros(
            len(layer_ids), dtype=torch.float64, device=device
        )  # per-token logit-grad norm max
        self._edges: dict = {}  # MARGIN_EDGES per device, in the logits' dtype
        self.router_grad_LEH: torch.Tensor | None = None

    def reset(self) -> None:
        """Start a step: statistics and router gradients accumulate over its minibatches."""
        self.stats_LXW.zero_()
        self.max_L.zero_()
        self.router_grad_LEH = None

    def add_router_grads(self, grads_LEH: torch.Tensor) -> None:
        """A minibatch's local (not yet reduced) router-weight gradients."""
        g = grads_LEH.detach().double()
        self.router_grad_LEH = g.clone() if self.router_grad_LEH is None else self.router_grad_LEH + g

    def _stats(self, device: torch.device) -> torch.Tensor:
        if self.stats_LXW.device != device:  # accumulate where the router runs: no host sync per layer
            self.stats_LXW, self.max_L = self.stats_LXW.to(device), self.max_L.to(device)
        return self.stats_LXW

    def observe_forward(self, pos: int, select_NE: torch.Tensor, native_NK: torch.Tensor) -> None:
        """``select_NE``: the scores megatron's top-k ranks (logits for softmax; sigmoid scores
        plus the expert bias for sigmoid routers), before any group masking."""
        s = self._stats(select_NE.device)[pos]
        select = select_NE.detach()  # the router's own dtype (fp32); sums accumulate in fp64
        s[LOAD, : self.E] += torch.bincount(native_NK.detach().reshape(-1), minlength=self.E)
        if self.spec.grouped:  # the K-th and (K+1)-th candidates both lie in the selected groups
            select = select.masked_fill(~group_mask(select, self.spec), float("-inf"))
        if self.K < self.E:
            top = torch.topk(select, self.K + 1, dim=-1, sorted=True).values
            margin_N = top[:, self.K - 1] - top[:, self.K]
            s[SCALARS, _MARGIN] += margin_N.sum()
            s[SCALARS, _NEAR] += (margin_N < self.near_eps).sum()
            s[SCALARS, _NEAR_BF16] += (margin_N < top[:, self.K - 1].abs() * BF16_RESOLUTION).sum()
            edges = self._edges.get(margin_N.device)
            if edges is None:
                edges = self._edges[margin_N.device] = MARGIN_EDGES.to(margin_N.device, margin_N.dtype)
            s[MARGIN_HIST, :NUM_BINS] += torch.bincount(
                torch.bucketize(margin_N, edges, right=True), minlength=NUM_BINS
            )
        s[SCALARS, _TOKENS] += select.shape[0]

    def observe_shared(self, pos: int, shared_NH: torch.Tensor, routed_NH: torch.Tensor) -> None:
        """One micro-batch's shared-expert output (after its gate) and routed-experts output, real
        tokens only: accumulates ||s|| / (||s|| + ||r||) per token (0 where both are zero)."""
        s = self._stats(shared_NH.device)[pos]
        s_N = shared_NH.detach().double().norm(dim=-1)
        r_N = routed_NH.detach().double().norm(dim=-1)
        s[SCALARS, _SHARED] += (s_N / (s_N + r_N).clamp(min=1e-300)).sum()
        s[SCALARS, _SHARED_TOK] += s_N.shape[0]

    def observe_grad(self, pos: int, grad_NE: torch.Tensor) -> None:
        s = self._stats(grad_NE.device)[pos]
        g = grad_NE.detach()
        # tokens the loss does not reach (padding, each sequence's last token) get no router
        # gradient at all; blackout is measured over the tokens that do
        nonzero_NE = g != 0
        live_N = nonzero_NE.any(-1)
        live = live_N.sum()
        s[SCALARS, _ZERO] += live * self.E - nonzero_NE.sum()  # zero entries of live tokens
        s[SCALARS, _ENTRIES] += live * self.E  # stays on the device: no sync per layer
        s[GRAD_MASS, : self.E] += g.abs().sum(0)
        norm_N = g.norm(dim=-1)  # zero on tokens without gradient: they add nothing
        s[SCALARS, _TOK_NORM] += norm_N.sum()
        s[SCALARS, _LIVE] += live
        self.max_L[pos] = torch.maximum(self.max_L[pos], norm_N.max() if norm_N.numel() else self.max_L[pos])

    def finalize(
        self, stats_LXW: torch.Tensor, max_L: torch.Tensor, router_grad_LEH: torch.Tensor
    ) -> dict[str, float]:
        """Per-layer metrics from globally reduced statistics, maxima and router-weight gradients."""
        out: dict[str, float] = {}
        zero_all = entries_all = shared_all = shared_tok_all = 0.0
        p_LE = expert_load_LE(stats_LXW, self.E)
        for pos, lid in enumerate(self.layer_ids):
            s = stats_LXW[pos]
            sc = [float(v) for v in s[SCALARS, :NUM_SCALARS]]
            load_E, mass_E = s[LOAD, : self.E], s[GRAD_MASS, : self.E]
            zero_all, entries_all = zero_all + sc[_ZERO], entries_all + sc[_ENTRIES]
            shared_all, shared_tok_all = shared_all + sc[_SHARED], shared_tok_all + sc[_SHARED_TOK]
            p_E = p_LE[pos]
            entropy = float(-(p_E * p_E.clamp(min=1e-30).log()).sum()) / math.log(self.E)
            tokens, live = sc[_TOKENS], sc[_LIVE]
            p1, p5, p50 = histogram_quantiles(s[MARGIN_HIST, :NUM_BINS], MARGIN_EDGES, MARGIN_QUANTILES)
            metrics = {
                "zero_frac": sc[_ZERO] / sc[_ENTRIES] if sc[_ENTRIES] else float("nan"),
                "norm": float(router_grad_LEH[pos].norm()),
                "logit_grad_norm_mean": sc[_TOK_NORM] / live if live else float("nan"),
                "logit_grad_norm_max": float(max_L[pos]),
                "never_selected": float((load_E == 0).sum()),
                "never_selected_frac": float((load_E == 0).double().mean()),
                "no_grad_expert_frac": float((mass_E == 0).double().mean()),
                "expert_grad_mass_per_token": float((mass_E / load_E.clamp(min=1)).mean()),
                "load_entropy": entropy,
                "load_max_frac": float(p_E.max()),
                "margin_mean": sc[_MARGIN] / tokens if tokens else float("nan"),
                "margin_p1": p1,
                "margin_p5": p5,
                "margin_p50": p50,
                "near_boundary_frac": sc[_NEAR] / tokens if tokens else float("nan"),
                "near_boundary_bf16_frac": sc[_NEAR_BF16] / tokens if tokens else float("nan"),
            }
            if self.shared_expert:
                metrics["shared_expert_share"] = (
                    sc[_SHARED] / sc[_SHARED_TOK] if sc[_SHARED_TOK] else float("nan")
                )
            out.update({f"router_grad/{k}/layer{lid}": v for k, v in metrics.items()})
        out["router_grad/zero_frac"] = zero_all / entries_all if entries_all else float("nan")
        out["router_grad/zero_frac_expected"] = self.expected_zero_frac
        out["router_grad/norm"] = float(router_grad_LEH.norm())
        if self.shared_expert:  # token-weighted over the MoE layers
            out["router_grad/shared_expert_share"] = (
                shared_all / shared_tok_all if shared_tok_all else float("nan")
            )
        return out


# rollout-vs-learner agreement (routing replay's names) -> this monitor's prefix
_ROLLOUT_ALIASES = {
    "routing/flip_router_frac": "router_grad/rollout_flip_frac",
    "routing/flip_token_frac": "router_grad/rollout_flip_token_frac",
    "routing/flip_layers_per_token": "router_grad/rollout_flip_layers_per_token",
}


def rollout_flip_aliases(route_metrics: dict) -> dict:
    """The old-log-prob pass's rollout-vs-learner flip rates, filed under ``router_grad/`` too."""
    out = {}
    for key, value in route_metrics.items():
        base, sep, layer = key.partition("/layer")
        if base in _ROLLOUT_ALIASES:
            out[_ROLLOUT_ALIASES[base] + (sep + layer if sep else "")] = value
    return out
