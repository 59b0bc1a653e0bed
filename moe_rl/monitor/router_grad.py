"""Router-gradient monitor: gradient blackout and routing stability, per MoE layer, every step.

Top-K routing gives an unselected expert's router logit exactly zero gradient (math.md 7): with
softmax over the top-k logits and no auxiliary loss, a fraction (E - K) / E of the router-logit
entries gets none, structurally. The monitor measures that and what follows from it, from the
update passes' own forwards and backwards (no extra pass):

- ``observe_forward`` (each update micro-batch, forward only, not on recompute): native Top-K of
  the router logits -> tokens routed per expert, Top-K margin (K-th minus (K+1)-th logit) and
  the fraction of tokens within ``near_eps`` of the boundary;
- ``observe_grad`` (the router logits' gradient, via a tensor hook): among tokens whose router
  got any gradient, the entries with exactly zero gradient; and per-expert gradient mass;
- ``finalize`` (once per step, after the caller reduced the packed [L, 3, max(E, 5)] statistics over
  data-parallel ranks in one all-reduce): per-layer metrics under ``router_grad/``.

Pure tensor code; the single collective lives with the caller (``Learner``).
Shape suffixes: N tokens, E experts, K top-k, L MoE layers.
"""

from __future__ import annotations

import math

import torch

# rows of the packed per-layer statistics [L, NUM_STATS, max(E, 5)]
LOAD, GRAD_MASS, SCALARS = 0, 1, 2  # SCALARS row: zero-grad entries, grad entries, margin sum, near, tokens
NUM_STATS = 3
_ZERO, _ENTRIES, _MARGIN, _NEAR, _TOKENS = range(5)


class RouterGradMonitor:
    def __init__(self, layer_ids: list[int], num_experts: int, top_k: int, near_eps: float = 0.1) -> None:
        self.layer_ids, self.E, self.K, self.near_eps = list(layer_ids), num_experts, top_k, near_eps
        width = max(num_experts, 5)  # the SCALARS row holds 5 numbers
        self.stats_LXE = torch.zeros(len(layer_ids), NUM_STATS, width, dtype=torch.float64)
        self.active = False  # observing only during update passes (set by the learner)
        self.router_grad_LEH: torch.Tensor | None = None

    def reset(self) -> None:
        """Start a step: statistics and router gradients accumulate over its minibatches."""
        self.stats_LXE.zero_()
        self.router_grad_LEH = None

    def add_router_grads(self, grads_LEH: torch.Tensor) -> None:
        """A minibatch's local (not yet reduced) router-weight gradients."""
        g = grads_LEH.detach().double()
        self.router_grad_LEH = g.clone() if self.router_grad_LEH is None else self.router_grad_LEH + g

    def _stats(self, device: torch.device) -> torch.Tensor:
        if self.stats_LXE.device != device:  # accumulate where the router runs: no host sync per layer
            self.stats_LXE = self.stats_LXE.to(device)
        return self.stats_LXE

    def observe_forward(self, pos: int, logits_NE: torch.Tensor, native_NK: torch.Tensor) -> None:
        s = self._stats(logits_NE.device)[pos]
        logits = logits_NE.detach().double()
        s[LOAD, :self.E] += torch.bincount(native_NK.detach().reshape(-1), minlength=self.E).double()
        if self.K < self.E:
            top = torch.topk(logits, self.K + 1, dim=-1).values
            margin_N = top[:, self.K - 1] - top[:, self.K]
            s[SCALARS, _MARGIN] += margin_N.sum()
            s[SCALARS, _NEAR] += (margin_N < self.near_eps).double().sum()
        s[SCALARS, _TOKENS] += logits.shape[0]

    def observe_grad(self, pos: int, grad_NE: torch.Tensor) -> None:
        s = self._stats(grad_NE.device)[pos]
        g = grad_NE.detach().double()
        # tokens the loss does not reach (padding, each sequence's last token) get no router
        # gradient at all; blackout is measured over the tokens that do
        live_N = (g != 0).any(-1)
        s[SCALARS, _ZERO] += (g[live_N] == 0).double().sum()
        s[SCALARS, _ENTRIES] += live_N.sum() * self.E  # stays on the device: no sync per layer
        s[GRAD_MASS, :self.E] += g.abs().sum(0)

    def finalize(self, stats_LXE: torch.Tensor, router_grad_LEH: torch.Tensor) -> dict[str, float]:
        """Per-layer metrics from globally reduced statistics and router-weight gradients."""
        out: dict[str, float] = {}
        zero_all = entries_all = 0.0
        for pos, lid in enumerate(self.layer_ids):
            s = stats_LXE[pos]
            load_E, mass_E = s[LOAD, :self.E], s[GRAD_MASS, :self.E]
            zero, entries, tokens = float(s[SCALARS, _ZERO]), float(s[SCALARS, _ENTRIES]), float(s[SCALARS, _TOKENS])
            zero_all, entries_all = zero_all + zero, entries_all + entries
            p_E = load_E / load_E.sum().clamp(min=1)
            entropy = float(-(p_E * p_E.clamp(min=1e-30).log()).sum()) / math.log(self.E)
            metrics = {
                "zero_frac": zero / entries if entries else float("nan"),
                "norm": float(router_grad_LEH[pos].norm()),
                "never_selected": float((load_E == 0).sum()),
                "load_entropy": entropy,
                "load_max_frac": float(p_E.max()),
                "margin_mean": float(s[SCALARS, _MARGIN]) / tokens if tokens else float("nan"),
                "near_boundary_frac": float(s[SCALARS, _NEAR]) / tokens if tokens else float("nan"),
                "expert_grad_mass_per_token": float((mass_E / load_E.clamp(min=1)).mean()),
                "no_grad_expert_frac": float((mass_E == 0).double().mean()),
            }
            out.update({f"router_grad/{k}/layer{lid}": v for k, v in metrics.items()})
        out["router_grad/zero_frac"] = zero_all / entries_all if entries_all else float("nan")
        out["router_grad/norm"] = float(router_grad_LEH.norm())
        return out
