"""Whole-model parity per HF family of issue 25 (DeepSeek-V3, GLM-4.5, Qwen2-MoE) against
transformers, through the project's real HF import (``load_config(init_weights=hf:DIR)`` and
``weights.hf.load_hf_checkpoint``).

Each case is a tiny random model built by transformers' own ``AutoModelForCausalLM.from_config``
(eager attention, eager experts), its weights redrawn so that nothing is at an identity value
(matrices and the embedding N(0, 1 / fan_in), norm weights 1 + N(0, 0.1^2), biases and the expert
bias N(0, 0.1^2), group 0's expert bias +0.3 so groups are of unequal use), saved by
``save_pretrained`` in shards. Odd on purpose: K = 3, 4 and 6 (3 and 6 not powers of two), 4
groups with 2 or 3 chosen, dense first layers, direct and low-rank q, tied and untied embeddings.

Asserted: the built-in engine (fp32) gives transformers' fp32 logits within ``LOGITS_ATOL`` (max
|diff| over the real tokens of a right-padded batch) and the same Top-K expert ids for every token
and MoE layer (transformers' from forward hooks on each ``mlp.gate``, ``output[2]``); our export of
the imported weights reloads in transformers bitwise (tied: no ``lm_head.weight`` in the files,
transformers' lm_head is its embedding). The megatron learner on 2 gloo ranks (one spawn): the
same logits bound and routes at EP=1 and EP=2, EP=2 equal to EP=1 within ``EP_ATOL``; with tied
embeddings the shared matrix's gradient is the sum of the embedding's and the lm_head's gradients
of an untied learner holding two copies of it, and one Adam step moves it once by exactly that
gradient (exported and reloaded by transformers: lm_head == embedding == the reference)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig, load_config
from moe_rl.weights import hf as hfc
from tests.dist_harness import run_ranks
from tests.hf_reference import hf_forward
from tests.models import deepseek_v3_tiny, glm4_moe_tiny, qwen2_moe_tiny

transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-5
EP_ATOL = 1e-6
B, S = 3, 12
LENS = (12, 7, 10)

# name -> the tiny ModelConfig whose config.json transformers builds the model from
CASES: dict[str, ModelConfig] = {
    # 4 groups of 3, 2 chosen, top-4 (megatron: 4 // 2 = 2, HF's best-2 group score), untied
    "deepseek_v3_g4of2_k4": deepseek_v3_tiny(num_layers=3, moe_router_group_topk=2, moe_router_topk=4),
    # 4 groups of 3, 3 chosen, top-6, q projected directly, tied
    "deepseek_v3_k6_tied_direct_q": deepseek_v3_tiny(num_layers=3, q_lora_rank=0, tie_word_embeddings=True),
    # top-3 of 6, no groups, tied (the helper's default), layer 0 dense
    "glm4_moe_k3_tied": glm4_moe_tiny(),
    # 4 groups of 2, 2 chosen, top-4, untied
    "glm4_moe_g4of2_untied": glm4_moe_tiny(
        tie_word_embeddings=False,
        num_experts=8,
        moe_router_topk=4,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
    ),
    # top-3 of 6 softmax without renormalisation, gated shared expert, every layer MoE, untied
    "qwen2_moe_k3": qwen2_moe_tiny(),
    # the same, tied, layer 0 dense
    "qwen2_moe_k3_tied_dense0": qwen2_moe_tiny(tie_word_embeddings=True, first_k_dense=1),
}
TIED = [n for n, c in CASES.items() if c.tie_word_embeddings]


def _redraw(model: object, cfg: ModelConfig, seed: int) -> None:
    """Every weight of transformers' model redrawn (see the module docstring); tied weights once."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is the embedding: listed once
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:  # linears [out, in], fused experts [E, out, in] and the embedding: N(0, 1 / fan_in)
                # (an N(0, 1) embedding read as a tied lm_head gives |logits| ~ 50, where one fp32
                # rounding step is 4e-6: the bound would measure rounding, not the model)
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
                per_group = cfg.num_experts // max(cfg.moe_router_num_groups, 1)
                b[:per_group] += 0.3  # group 0 favoured: groups of unequal use


def _eager(model: object) -> object:
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    return model.eval()


def make_checkpoint(root: Path, name: str) -> Path:
    """transformers builds case ``name`` from its config.json, redraws it and saves it in shards."""
    cfg = CASES[name]
    hf_cfg = transformers.AutoConfig.for_model(**hfc.hf_config_dict(cfg))
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    _redraw(model, cfg, seed=sorted(CASES).index(name))
    out = root / name
    model.save_pretrained(str(out), max_shard_size="100KB")
    return out


def load_reference(path: Path) -> object:
    """The checkpoint in transformers, the plainest code paths (eager attention and experts)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return _eager(model)


def import_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The project's real import: the model section from config.json, then the canonical weights."""
    run = load_config(None, [f"init_weights=hf:{path}", "task.tokenizer=builtin:char"])
    return run.model, hfc.load_hf_checkpoint(path, run.model)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch (pads are token 0) and its bool mask of real tokens."""
    valid_BS = torch.arange(S)[None] < torch.tensor(LENS)[:, None]
    tokens_BS = torch.randint(1, 40, (B, S), generator=torch.Generator().manual_seed(9))
    return tokens_BS.masked_fill(~valid_BS, 0), valid_BS


def hf_logits_and_ids(model: object, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' fp32 logits [B, S, V] and Top-K ids [B, S, L_moe, K] (sorted over K: HF's topk
    is unsorted), from forward hooks on every MoE layer's router (``mlp.gate``, ``output[2]``)."""
    logits_BSV, ids_BSLK = hf_forward(model, cfg, *batch())
    return logits_BSV, ids_BSLK.sort(-1).values


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: make_checkpoint(root, name) for name in CASES}


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(CASES))
def test_builtin_engine_equals_transformers(checkpoints: dict[str, Path], name: str) -> None:
    from moe_rl.rollout.builtin_model import BuiltinMoEModel

    model, canon = import_checkpoint(checkpoints[name])
    assert model == dataclasses.replace(CASES[name], max_seq_len=ModelConfig.max_seq_len)
    assert ("lm_head.weight" in canon) != model.tie_word_embeddings
    ref = load_reference(checkpoints[name])
    hf_logits, hf_ids = hf_logits_and_ids(ref, model)
    eng = BuiltinMoEModel(model, torch.float32)
    eng.load_canonical(canon)
    tokens_BS, valid_BS = batch()
    out = eng.forward(tokens_BS, torch.arange(S).expand(B, S), valid_BS)
    diff = float((out.logits - hf_logits)[valid_BS].abs().max())
    top = float(hf_logits[valid_BS].abs().max())
    print(f"{name}: engine max |logits - transformers| {diff:.2e} (|logits| up to {top:.1f})")
    assert diff < LOGITS_ATOL, diff
    assert top > 1  # logits of real size, not near 0
    ids = out.expert_ids_BTLK.sort(-1).values
    assert torch.equal(ids[valid_BS], hf_ids[valid_BS])
    if model.moe_router_num_groups > 1:  # groups of unequal use: group 0 chosen most
        per_group = model.num_experts // model.moe_router_num_groups
        used = torch.bincount(
            (hf_ids[valid_BS] // per_group).flatten(), minlength=model.moe_router_num_groups
        )
        assert int(used[0]) == int(used.max()) > int(used.min()), used


@pytest.mark.unit
@pytest.mark.parametrize("name", TIED)
def test_tied_export_reloads_in_transformers_bitwise(
    checkpoints: dict[str, Path], tmp_path: Path, name: str
) -> None:
    model, canon = import_checkpoint(checkpoints[name])
    out = hfc.write_hf_checkpoint(tmp_path / "export", canon, model, max_shard_bytes=100_000)
    assert "lm_head.weight" not in hfc.read_hf_weights(out, model)  # transformers saves none either
    ref, back = load_reference(checkpoints[name]), load_reference(out)
    assert back.lm_head.weight is back.model.embed_tokens.weight  # transformers tied it again
    sd, ref_sd = back.state_dict(), ref.state_dict()
    assert sorted(sd) == sorted(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


# ------------------------------------------------------------------ the learner, 2 gloo ranks


def _learner_logits_and_ids(gpt, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's logits [B, S, V] and Top-K ids [B, S, L_moe, K] (sorted), from hooks on each
    router's routing_map (megatron routes sequence-major rows [S * B])."""
    maps: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.router.register_forward_hook(
            lambda _m, _i, out, n=layer.layer_number - 1: maps.__setitem__(n, out[1])
        )
        for layer in gpt.decoder.layers
        if getattr(layer.mlp, "router", None) is not None
    ]
    tokens_BS, _ = batch()
    gpt.eval()
    with torch.no_grad():
        logits = gpt(tokens_BS, torch.arange(S).expand(B, S), None)
    for h in hooks:
        h.remove()
    K = cfg.moe_router_topk
    ids = [
        maps[i].view(S, B, -1).transpose(0, 1).nonzero()[:, 2].view(B, S, K) for i in cfg.moe_layers
    ]  # nonzero lists each row's True columns in increasing order: sorted ids
    return logits, torch.stack(ids, dim=2)


def _nll(mb, st, normalizer):
    return -(st.logp_BS * mb.loss_mask_BS).sum() / normalizer, {}


def _train_batch(cfg: ModelConfig):
    from moe_rl.types import TrainBatch

    tokens_BS, valid_BS = batch()
    return TrainBatch(tokens_BS, torch.tensor(LENS), loss_mask_BS=valid_BS & (torch.arange(S)[None] >= 2))


LR = 1e-2


def _tied_training(cfg: ModelConfig, canon: dict, par: ParallelConfig, ctx, out_dir: Path, rank: int) -> dict:
    """The tied matrix's gradient vs an untied learner's two gradients, and one Adam step."""
    from moe_rl.learner.learner import Learner

    optim = OptimConfig(lr=LR, clip_grad=1e9)  # no clipping: Adam's first step is lr * g / (|g| + eps)
    tied = Learner(cfg, par, optim, ctx, canon, monitor=False)
    untied_cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    two = {**canon, "lm_head.weight": canon["model.embed_tokens.weight"].clone()}
    untied = Learner(untied_cfg, par, optim, ctx, two, monitor=False)
    tb = _train_batch(cfg)
    tied.forward_backward(tb, _nll, 1.0, 2)
    untied.forward_backward(tb, _nll, 1.0, 2)
    g_VH = tied.canonical_grads()["model.embed_tokens.weight"]
    ug = untied.canonical_grads()
    parts = (ug["model.embed_tokens.weight"], ug["lm_head.weight"])
    w0_VH = canon["model.embed_tokens.weight"]
    tied.update(tb, _nll, 1.0, 2, lr=LR)
    stepped = tied.export_canonical()  # collective: every rank
    w1_VH = stepped["model.embed_tokens.weight"]
    want_VH = w0_VH - LR * g_VH / (g_VH.abs() + optim.adam_eps)
    if rank == 0:
        hfc.write_hf_checkpoint(out_dir / "tied_step", stepped, cfg, max_shard_bytes=100_000)
    return {
        "grad_sum_err": float((g_VH - parts[0] - parts[1]).abs().max() / g_VH.abs().max()),
        "grad_parts_nonzero": min(float(p.abs().max()) for p in parts),
        "step_err": float((w1_VH - want_VH).abs().max()),
        "moved": float((w1_VH - w0_VH).abs().max()),
        "w1": w1_VH.numpy(),
        "names": sorted(n for n, _ in tied.gpt.named_parameters()),
    }


def _worker(rank: int, dirs: dict[str, str], out_root: str) -> dict:
    from megatron.core import parallel_state as ps

    from moe_rl import dist
    from moe_rl.learner.learner import Learner

    out: dict = {}
    par2 = ParallelConfig(nproc=2, expert_parallel=2, distributed_optimizer=False)
    ctx2 = dist.init_distributed(par2, seed=7)
    imported = {name: import_checkpoint(Path(d)) for name, d in dirs.items()}
    for name, (cfg, canon) in imported.items():
        learner = Learner(cfg, par2, OptimConfig(), ctx2, canon, monitor=False)
        logits, ids = _learner_logits_and_ids(learner.gpt, cfg)
        out[name] = {"ep2_logits": logits.numpy(), "ep2_ids": ids.numpy()}
    tied_name = "glm4_moe_k3_tied"
    out["train"] = _tied_training(*imported[tied_name][:2], par2, ctx2, Path(out_root), rank)
    ps.destroy_model_parallel()
    par1 = ParallelConfig(nproc=2, expert_parallel=1, distributed_optimizer=False)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    ctx1 = dist.ParallelDims.from_parallel_state()
    for name, (cfg, canon) in imported.items():
        learner = Learner(cfg, par1, OptimConfig(), ctx1, canon, monitor=False)
        logits, ids = _learner_logits_and_ids(learner.gpt, cfg)
        out[name].update(ep1_logits=logits.numpy(), ep1_ids=ids.numpy())
    dist.shutdown()
    # through a file: both ranks' results share one pipe that is read only after they exit
    torch.save(out, Path(out_root) / f"rank{rank}.pt")
    return {}


@pytest.mark.dist
def test_learner_equals_transformers_ep1_ep2_and_tied_training(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    run_ranks(_worker, 2, {n: str(p) for n, p in checkpoints.items()}, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    _, valid_BS = batch()
    diffs = {}
    for name in CASES:
        ref = load_reference(checkpoints[name])
        hf_logits, hf_ids = hf_logits_and_ids(ref, CASES[name])
        for rank, r in enumerate(ranks):
            got = {k: torch.from_numpy(v) for k, v in r[name].items()}
            for ep in ("ep1", "ep2"):
                diffs[name, ep, rank] = float((got[f"{ep}_logits"] - hf_logits)[valid_BS].abs().max())
                assert torch.equal(got[f"{ep}_ids"][valid_BS], hf_ids[valid_BS]), (name, ep, rank)
            ep_diff = float((got["ep2_logits"] - got["ep1_logits"]).abs().max())
            diffs[name, "ep2-ep1", rank] = ep_diff
            assert ep_diff <= EP_ATOL, (name, rank, ep_diff)
    print("max |diff|:", {"/".join(map(str, k)): f"{v:.2e}" for k, v in diffs.items()})
    assert max(v for k, v in diffs.items() if k[1] != "ep2-ep1") < LOGITS_ATOL, diffs

    # tied embeddings: one matrix, one update of the summed gradient
    for rank, r in enumerate(ranks):
        t = r["train"]
        print(f"tied rank {rank}:", {k: f"{t[k]:.2e}" for k in ("grad_sum_err", "step_err", "moved")})
        assert "output_layer.weight" not in t["names"], rank  # megatron reads the embedding
        assert t["grad_parts_nonzero"] > 1e-4, (rank, t)  # both uses really contribute
        assert t["grad_sum_err"] < 1e-6, (rank, t)
        assert t["moved"] > 0.5 * LR and t["step_err"] < 1e-7, (rank, t)
    w1_VH = torch.from_numpy(ranks[0]["train"]["w1"])
    assert torch.equal(w1_VH, torch.from_numpy(ranks[1]["train"]["w1"]))
    back = load_reference(tmp_path / "tied_step")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert torch.equal(back.model.embed_tokens.weight.detach(), w1_VH)
