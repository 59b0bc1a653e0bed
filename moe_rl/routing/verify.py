"""The route verifier (``routing.verify``, docs/agentic.md 9): does a stitched multi-turn route trace
equal what one full forward gives?

Every ``every`` steps, on ``samples`` of the step's trajectories, the rollout engine runs one full
no-cache prefill of each whole sequence at the weights it holds (``BuiltinEngine.prefill_routes``),
and its routes are compared row for row with the trace the agent loop stitched from the turns,
wherever the provenance (docs/design.md 5.1) says they should be equal: rows with ids computed,
prefix-hit or re-prefilled at the engine's current version. Rows of another version (an update
landed between turns) and rows with no route are not compared and are counted apart. So is each
(row, layer) pair whose Top-K margin in the verifying prefill is below ``margin``: there, the other
batch shape of the turn's forward may round to the other expert (near ties). A pair mismatches when
its expert *sets* differ.

Shape suffixes: B samples, S positions, N rows, L MoE layers, K top-k, T turns (0 .. num_turns).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moe_rl.maths.versions import sum_by_lag
from moe_rl.metrics import Max, Mean, Sum
from moe_rl.routing.provenance import COMPUTED, NONE, PREFIX_HIT, REPREFILL, Provenance
from moe_rl.routing.topk_overlap import topk_agreement
from moe_rl.types import RolloutBatch

SHOULD_EQUAL = (COMPUTED, PREFIX_HIT, REPREFILL)  # at the engine's current version
_PICK_SEED = 0x5DEECE66D  # decorrelates the sample pick from the rollout's sampling


@dataclass(frozen=True)
class VerifyPlan:
    """The resolved ``routing.verify`` of a run (``every`` 0: off)."""

    every: int
    samples: int
    margin: float
    layer_ids: tuple[int, ...]  # the record's MoE layers (metric names)
    num_turns: int  # agent.max_turns (the per-turn keys)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0


def pick_samples(num: int, k: int, seed: int) -> torch.Tensor:
    """int64 [min(k, num)]: which samples to verify, sorted, from a generator of their own."""
    g = torch.Generator().manual_seed((seed ^ _PICK_SEED) % 2**63)
    return torch.randperm(num, generator=g)[: min(k, num)].sort().values


def compare_routes(
    ref_NLK: torch.Tensor,
    margin_NL: torch.Tensor,
    stitched_NLK: torch.Tensor,
    prov: Provenance,
    version: int,
    plan: VerifyPlan,
) -> dict:
    """The verifier's metrics from the reference prefill's routes and margins and the stitched rows
    (the same N rows, in order) with their provenance; ``version``: the engine's weight version.

    ``routing/verify_mismatch_frac`` (and ``/layer<id>``, ``/turn<k>``): mismatching (row, layer)
    pairs over the compared ones; ``routing/verify_rows_compared``, ``_other_version``,
    ``_no_route``: rows; ``routing/verify_near_tie_frac``: the should-equal rows' pairs left out for
    their margin."""
    src_N = prov.source_N.long()
    should_N = torch.isin(src_N, torch.tensor(SHOULD_EQUAL)) & (prov.version_N == version)
    other_N = (src_N != NONE) & (prov.version_N != version)
    pair_NL = should_N[:, None] & (margin_NL >= plan.margin)
    differs_NL = topk_agreement(ref_NLK.long(), stitched_NLK.long())[0] & pair_NL
    L = pair_NL.shape[1]
    bad_L, pairs_L = differs_NL.double().sum(0), pair_NL.double().sum(0)
    turn_N = torch.where(should_N, prov.turn_N.long(), 0).clamp(0, plan.num_turns)
    bad_T = sum_by_lag(differs_NL.sum(1), turn_N, plan.num_turns + 1)
    pairs_T = sum_by_lag(pair_NL.sum(1), turn_N, plan.num_turns + 1)
    out = {
        "routing/verify_mismatch_frac": Mean(bad_L.sum(), pairs_L.sum()),
        "routing/verify_rows_compared": Sum(float(should_N.sum())),
        "routing/verify_rows_other_version": Sum(float(other_N.sum())),
        "routing/verify_rows_no_route": Sum(float((src_N == NONE).sum())),
        "routing/verify_near_tie_frac": Mean(
            float(should_N.sum()) * L - pairs_L.sum(), float(should_N.sum()) * L
        ),
    }
    for i, lid in enumerate(plan.layer_ids):
        out[f"routing/verify_mismatch_frac/layer{lid}"] = Mean(bad_L[i], pairs_L[i])
    for k in range(1, plan.num_turns + 1):
        out[f"routing/verify_mismatch_frac/turn{k}"] = Mean(bad_T[k], pairs_T[k])
    return out


def verify_batch(engine, batch: RolloutBatch, plan: VerifyPlan, seed: int) -> dict:
    """Verify ``plan.samples`` of ``batch``'s trajectories on ``engine`` (which made the batch and
    still holds the weights of its last forward): ``compare_routes``' metrics, the samples and the
    seconds it took (``time/verify_s``)."""
    t0 = time.perf_counter()
    if batch.route_prov is None:
        raise ValueError("route verifier: the batch's routes carry no provenance (docs/design.md 5.1)")
    idx = pick_samples(batch.num_seqs, plan.samples, seed).tolist()
    seqs_len = (batch.prompt_lens_B + batch.response_lens_B).cpu()
    tokens = batch.tokens_BS.cpu()
    seqs = [tokens[b, : int(seqs_len[b])].tolist() for b in idx]
    ref_BSLK, margin_BSL = engine.prefill_routes(seqs)
    rows_B = torch.tensor([batch.routes[b].shape[0] for b in idx])
    take_BS = torch.arange(ref_BSLK.shape[1])[None, :] < rows_B[:, None]  # row t is token t's
    stitched_NLK = torch.cat([batch.routes[b] for b in idx]).cpu()
    prov = Provenance.cat([batch.route_prov[b] for b in idx]).cpu()
    out = compare_routes(ref_BSLK[take_BS], margin_BSL[take_BS], stitched_NLK, prov, engine.version, plan)
    out["routing/verify_samples"] = Sum(float(len(idx)))
    out["time/verify_s"] = Max(time.perf_counter() - t0)
    return out
