"""unit tier: moe_rl/weights/outliers.py and scripts/plant_outliers.py (docs/collapse_lab.md 4,
"real-model outliers, planted"): the planted warm start computes bit-identical logits in fp32 and
bf16 on the built-in engine, while its planted activation channels are exactly alpha times larger."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import RunConfig
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.rollout.fp8 import fake_quant_act_tensor
from moe_rl.tasks.task import resolve_vocab
from moe_rl.tasks.tokenizer import CharTokenizer
from moe_rl.weights import outliers
from moe_rl.weights.outliers import plant_outliers
from moe_rl.weights.warmstart import BUILTIN, builtin_path, info, load_init_weights, open_init_weights
from tests.script_module import script_module

TOK = CharTokenizer()
CFG = resolve_vocab(RunConfig(), TOK).model
B, S = 6, 20


def forward(weights, dtype: str, record: list | None = None, **engine_kw):
    """Logits and expert ids of a no-cache forward over fixed tokens; ``record`` gets each linear
    input's per-channel amax, in call order (per layer: attention in, o_proj in, experts in, down in)."""
    eng = BuiltinEngine(CFG, dtype=dtype, pad_id=TOK.pad_id, **engine_kw)
    eng.load_weights(weights)
    if record is not None:
        m = eng.model

        def rec(f):
            return lambda x: (record.append(x.float().abs().reshape(-1, x.shape[-1]).amax(0)), f(x))[1]

        m.aq, m.aq_experts = rec(m.aq), rec(m.aq_experts)
    return forward_eng(eng)


def forward_eng(eng):
    toks_BS = torch.randint(3, CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    out = eng.model.forward(toks_BS, torch.arange(S).expand(B, S), torch.ones(B, S, dtype=torch.bool))
    return out.logits, out.expert_ids_BTLK


@pytest.fixture(scope="module")
def shipped():
    return load_init_weights(BUILTIN, CFG, TOK)


@pytest.mark.unit
@pytest.mark.parametrize("where, planted_call", [("norm", (0, 2)), ("down", (3,))])
def test_same_logits_and_alpha_times_the_channel_max(shipped, where, planted_call):
    alpha = 1024.0
    planted, done = plant_outliers(shipped, CFG, alpha, where, 4)
    ch_C = torch.tensor(done["channels"])
    assert len(ch_C) == 4 and done["scaled_up"] == (8 if where == "norm" else 32)
    for dtype in ("fp32", "bf16"):
        ref_BSV, ids_ref = forward(shipped, dtype)
        got_BSV, ids_got = forward(planted, dtype)
        assert torch.equal(got_BSV, ref_BSV) and torch.equal(ids_got, ids_ref), dtype
    rec0, rec1 = [], []
    forward(shipped, "fp32", rec0)
    forward(planted, "fp32", rec1)
    assert len(rec0) == len(rec1) == 4 * CFG.num_layers
    for call, (a0_C, a1_C) in enumerate(zip(rec0, rec1)):
        want_C = torch.ones_like(a0_C)
        if call % 4 in planted_call:
            want_C[ch_C] = alpha
        assert torch.equal(a1_C, a0_C * want_C), (where, call)
    # the outlier is visible: largest over median channel max, < 12 before, 1.1e3-2.3e3 after
    ratio = [float(a.max() / a.median()) for a in rec1[planted_call[0] :: 4]]
    assert min(ratio) > 500 and max(float(a.max() / a.median()) for a in rec0) < 15


@pytest.mark.unit
def test_a_broken_plant_changes_the_logits(shipped, monkeypatch):
    planted, _ = plant_outliers(shipped, CFG, 1024.0, "norm", 4)
    # scale only the norms: the readers keep their columns, so channel d comes out 1024x too large
    norms_only = {k: planted[k] if "layernorm" in k else v for k, v in shipped.items()}
    ref_BSV, _ = forward(shipped, "fp32")
    assert (forward(norms_only, "fp32")[0] - ref_BSV).abs().max() > 1.0
    # why alpha must be a power of two: x3 then /3 rounds, fp32 a little and bf16 visibly (0.29)
    monkeypatch.setattr(outliers, "check_alpha", lambda alpha: None)
    by3, _ = plant_outliers(shipped, CFG, 3.0, "norm", 4)
    assert 0 < (forward(by3, "fp32")[0] - ref_BSV).abs().max() < 1e-4
    assert (forward(by3, "bf16")[0] - forward(shipped, "bf16")[0]).abs().max() > 0.1


@pytest.mark.unit
def test_per_tensor_fp8_error_of_the_other_channels_stays_until_e4m3_range_runs_out(shipped):
    """e4m3 is a float: one per-tensor scale set by an outlier alpha times the rest only hurts the
    values it pushes below e4m3's smallest normal (amax / 2.9e4). The down_proj input's other
    channels keep their relative FP8 error (2.6%) up to alpha 1024, and lose it at 16384."""
    err = {}
    for alpha in (1.0, 1024.0, 16384.0):
        planted, done = plant_outliers(shipped, CFG, alpha, "down", 4)
        rec = []
        eng = BuiltinEngine(CFG, dtype="fp32", pad_id=TOK.pad_id)
        eng.load_weights(planted)
        eng.model.aq_experts = lambda x: (rec.append(x.reshape(-1, x.shape[-1])), x)[1]
        forward_eng(eng)
        h_TF = rec[1]  # layer 0's down_proj input, every routed pair
        rest = torch.ones(h_TF.shape[1], dtype=torch.bool)
        rest[done["channels"]] = False
        d = (fake_quant_act_tensor(h_TF) - h_TF)[:, rest]
        err[alpha] = float(d.norm() / h_TF[:, rest].norm())
    assert 0.02 < err[1.0] < 0.03 and abs(err[1024.0] / err[1.0] - 1) < 0.1, err
    assert err[16384.0] > 2 * err[1.0], err


@pytest.mark.unit
def test_bad_input(shipped):
    for alpha, match in ((3.0, "power of two"), (0.0, "power of two"), (2.0**120, "normal float range")):
        with pytest.raises(ValueError, match=match):
            plant_outliers(shipped, CFG, alpha, "norm", 4)
    with pytest.raises(ValueError, match=r"channels must be in \[1, 128\]"):
        plant_outliers(shipped, CFG, 16, "norm", 0)
    with pytest.raises(ValueError, match="where must be one of"):
        plant_outliers(shipped, CFG, 16, "up", 4)
    attn_less = {k: v for k, v in shipped.items() if "layers.2.self_attn" not in k}
    with pytest.raises(ValueError, match="layer 2: no linear layer reads input_layernorm"):
        plant_outliers(attn_less, CFG, 16, "norm", 4)


@pytest.mark.unit
def test_script_writes_a_loadable_warm_start(shipped, tmp_path, capsys):
    ps = script_module("plant_outliers")
    out = tmp_path / "ws_down16.safetensors"
    ps.main(["--in", BUILTIN, "--out", str(out), "--alpha", "16", "--where", "down", "--channels", "2"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] == "logits bit-identical to the original's: fp32 True, bf16 True"
    # the down_proj input's max/median grows (16x its planted channels), the others' stay
    ratios = {ln.split()[0]: ln.split()[2:5:2] for ln in printed[3:]}
    assert (
        ratios["attention"][0] == ratios["attention"][1] and ratios["down_proj"][0] != ratios["down_proj"][1]
    )
    planted, done = plant_outliers(shipped, CFG, 16, "down", 2)
    loaded = open_init_weights(str(out), CFG, TOK).read_all()  # init_weights=FILE's own check
    assert loaded.keys() == planted.keys() and all(torch.equal(loaded[k], planted[k]) for k in planted)
    meta = info(out)
    assert (
        meta["outliers"] == done and meta["sft_steps"] == info(builtin_path(BUILTIN)).get("sft_steps") == 80
    )
    for argv, msg in (
        (["--alpha", "3", "--where", "norm"], "alpha must be a power of two"),
        (["--in", str(tmp_path / "nope"), "--alpha", "2", "--where", "norm"], "no such file"),
    ):
        with pytest.raises(SystemExit) as exc:
            ps.main([*argv, "--out", str(tmp_path / "x.safetensors")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith("error: --in ") and msg in err and err.count("\n") == 1
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.unit
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen2_moe", "dense_first"])
def test_every_family_keeps_its_logits(family):
    """MLA (q_a / kv_a read the norm), shared experts and their gate, dense first layers: every
    reader is found, so fp32 and bf16 logits stay bit-identical with both kinds of outliers."""
    from moe_rl.weights.canonical import random_canonical_weights
    from tests.models import TINY_MOE_L3, deepseek_v3_tiny, glm4_moe_tiny, qwen2_moe_tiny

    cfg = {
        "deepseek_v3": deepseek_v3_tiny,
        "glm4_moe": glm4_moe_tiny,
        "qwen2_moe": qwen2_moe_tiny,
        "dense_first": lambda: TINY_MOE_L3,
    }[family]()
    weights = random_canonical_weights(cfg, 0)
    toks_BS = torch.randint(3, cfg.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    pos_BS, valid_BS = torch.arange(12).expand(4, 12), torch.ones(4, 12, dtype=torch.bool)

    def logits(w, dtype):
        eng = BuiltinEngine(cfg, dtype=dtype, pad_id=0)
        eng.load_weights(w)
        return eng.model.forward(toks_BS, pos_BS, valid_BS).logits

    for where in ("norm", "down"):
        planted, done = plant_outliers(weights, cfg, 1024.0, where, 3)
        changed = [k for k in weights if not torch.equal(planted[k], weights[k])]
        assert len(changed) == done["scaled_up"] + done["scaled_down"]
        for dtype in ("fp32", "bf16"):
            assert torch.equal(logits(planted, dtype), logits(weights, dtype)), (where, dtype)
