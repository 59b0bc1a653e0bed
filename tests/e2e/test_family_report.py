"""e2e of issue 25 point 6: the router monitor and ``moe-rl report`` on a real short run of a
DeepSeek-V3-shaped checkpoint (layer 0 dense, a shared expert, sigmoid + expert bias, 12 experts
in 4 groups, top-6): blackout per MoE layer only and exactly (E - K) / E through the sigmoid
gates, the shared expert's share per MoE layer, and the report's HTML labelling layer 0 dense
and stating the shares it read."""

from __future__ import annotations

import re
from pathlib import Path

import html5lib
import numpy as np
import pytest

from moe_rl.metrics import read_metrics
from tests.e2e.helpers import family_checkpoint, metrics, moe_rl
from tests.models import deepseek_v3_tiny

transformers = pytest.importorskip("transformers")


@pytest.mark.e2e
def test_deepseek_v3_run_monitor_and_report_know_dense_layers_and_the_shared_expert(tmp_path: Path) -> None:
    model_dir, _ = family_checkpoint(tmp_path, "deepseek_v3")
    cfg = deepseek_v3_tiny()
    moe_layers, E, K = cfg.moe_layers, cfg.num_experts, cfg.moe_router_topk
    assert cfg.first_k_dense == 1 and moe_layers == [1, 2, 3]
    data = tmp_path / "train.jsonl"
    moe_rl("data", "make-math", str(data), "--num", "16", "--seed", "2")
    # a reward that varies within every group (a random model solves no math): non-zero
    # advantages, so the router gets gradient and blackout is measured on every step
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def reward(prompt, response, ground_truth, extra):\n    return float(sum(map(ord, response)) % 7)\n"
    )
    run = tmp_path / "run"
    moe_rl(
        "train",
        f"run_dir={run}",
        "steps=2",
        f"init_weights=hf:{model_dir}",
        "model.max_seq_len=128",
        f"task.dataset={data}",
        "task.answer_key=reward_model.ground_truth",
        "task.apply_chat_template=true",
        "task.chat_template_kwargs.enable_thinking=false",
        f"task.reward=python:{reward}:reward",
        "task.max_prompt_tokens=64",
        "parallel.nproc=2",
        "parallel.expert_parallel=2",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=8",
        "algo.num_minibatches=1",
        "log.progress_bar=false",
        "log.wandb_mode=disabled",
    )
    recs = metrics(run)
    shares: dict[int, list[float]] = {lid: [] for lid in moe_layers}
    for step in (0, 1):
        r = recs[step]
        assert r["train/skipped_minibatches"] == 0, step
        # per MoE layer only: the dense layer has no router and no key
        assert not [k for k in r if k.startswith("router_grad/") and k.endswith("/layer0")], step
        for lid in moe_layers:
            # sigmoid gates renormalised over K: exactly (E - K) / E of the live entries get none
            assert r[f"router_grad/zero_frac/layer{lid}"] == (E - K) / E, (step, lid)
            share = r[f"router_grad/shared_expert_share/layer{lid}"]
            assert 0 < share < 1, (step, lid, share)
            shares[lid].append(share)
            assert r[f"router_grad/margin_mean/layer{lid}"] > 0
        assert r["router_grad/zero_frac_expected"] == (E - K) / E
        # every MoE layer sees the same tokens: the token-weighted whole is the layers' mean
        whole = np.mean([r[f"router_grad/shared_expert_share/layer{lid}"] for lid in moe_layers])
        assert r["router_grad/shared_expert_share"] == pytest.approx(whole, rel=1e-12)

    # per-expert load, a vector per MoE layer and step (expert_load.jsonl): the monitor's own counts
    loads, _ = read_metrics(run / "expert_load.jsonl")
    assert [r["step"] for r in loads] == [0, 1]
    for rec in loads:
        r = recs[rec["step"]]
        assert sorted(rec["layers"]) == [str(lid) for lid in moe_layers]  # no dense layer
        for lid in moe_layers:
            load_E = np.asarray(rec["layers"][str(lid)])
            assert load_E.shape == (E,) and load_E.sum() == pytest.approx(1.0, abs=1e-12)
            assert load_E.max() == r[f"router_grad/load_max_frac/layer{lid}"], lid
            assert (load_E == 0).sum() == r[f"router_grad/never_selected/layer{lid}"], lid

    moe_rl("report", str(run))
    html = (run / "report" / "report.html").read_text()
    html5lib.HTMLParser(strict=True).parse(html)
    rows = dict(re.findall(r"<tr class=\"\w+\"><td>(layer \d+(?: \(dense\))?)</td><td>(.*?)</td></tr>", html))
    assert list(rows) == ["layer 0 (dense)", "layer 1", "layer 2", "layer 3"], list(rows)
    assert (
        rows["layer 0 (dense)"]
        == "dense: an MLP without router (model.first_k_dense = 1): no routing metrics"
    )
    S, F = cfg.moe_shared_expert_ffn_hidden_size, cfg.moe_ffn_hidden_size
    flops = f"{S / (S + K * F):.1%}"  # 16 / (16 + 6 x 16) = 14.3%
    for lid in moe_layers:
        want = (
            f"shared expert {np.mean(shares[lid]):.1%} of the MoE output norm ({flops} of its expert FLOPs)"
        )
        assert want in rows[f"layer {lid}"], (lid, rows[f"layer {lid}"])
        assert "zero-gradient fraction 0.500 vs structural 0.500" in rows[f"layer {lid}"]
    mean_whole = np.mean([recs[s]["router_grad/shared_expert_share"] for s in (0, 1)])
    assert (
        f'<td>shared-expert share of the MoE output norm (mean)</td><td class="num">{mean_whole:.4g}</td>'
        in html
    )
    assert (
        f'<td>shared-expert share of the expert FLOPs, S/(S+K F)</td><td class="num">{16 / 112:.4g}</td>'
        in html
    )
    assert '<td>dense layers (no router)</td><td class="num">0</td>' in html
    assert "<figcaption>router_grad/shared_expert_share/layer*</figcaption>" in html
    assert "<figcaption>expert_load.jsonl</figcaption>" in html
    md = (run / "report" / "report.md").read_text()
    assert "- layer 0 (dense) **dense**: an MLP without router" in md
