"""rollout.staleness=k: the weight-set queue (unit) and real training runs on 2 ranks (dist) in
which every weight set the engine loads is identified, bitwise, with a learner export."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.errors import ConfigError
from moe_rl.pipeline.simulated_staleness import SimulatedStaleness
from tests.dist_harness import run_ranks


def _set(v: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((2,), v), "b": torch.full((1,), -v)}


@pytest.mark.unit
def test_queue_serves_the_weights_of_k_steps_ago_and_the_first_k_steps_the_initial_ones():
    stale = SimulatedStaleness(2)
    served = [stale.push(_set(0.0))["a"][0].item()]  # W_0
    lags = []
    for t in range(5):
        lags.append(stale.metrics()["rollout/policy_lag"])
        w = _set(float(t + 1))  # W_{t+1}, the weights after step t's update
        served.append(stale.push(w)["a"][0].item())
        w["a"].add_(100.0)  # the learner updates in place: the kept copy must not move
    # step t's rollout runs on served[t] = W_max(0, t-2)
    assert served == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]
    assert lags == [0.0, 1.0, 2.0, 2.0, 2.0]
    # resume state: a fresh queue restored from it serves the same set next
    again = SimulatedStaleness(2)
    again.load_state_dict(stale.state_dict(), torch.device("cpu"))
    assert again.resume_push(_set(5.0))["a"][0].item() == 3.0
    with pytest.raises(ValueError, match="do not end with the checkpoint's weights"):
        again.resume_push(_set(4.0))
    with pytest.raises(ValueError, match="rollout.staleness=2, this run has rollout.staleness=1"):
        SimulatedStaleness(1).load_state_dict(stale.state_dict(), torch.device("cpu"))


@pytest.mark.unit
def test_staleness_zero_is_the_synced_path_without_copies():
    stale, w = SimulatedStaleness(0), _set(1.0)
    assert stale.push(w) is w and stale.push(_set(2.0)) is not w  # the export itself, as before
    assert stale.metrics() == {} and stale.state_dict()["sets"] == []
    assert load_config(None).rollout.staleness == 0
    with pytest.raises(ConfigError, match=r"'rollout.staleness': must be >= 0 \(got -1\)"):
        load_config(None, ["rollout.staleness=-1"])


@pytest.mark.unit
def test_resume_without_the_stale_weight_sets_names_the_file(tmp_path):
    from moe_rl.checkpointing import CheckpointManager
    from moe_rl.errors import RunDirError

    ckpt_dir = tmp_path / "checkpoints" / "step_000002"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "trainer_state.json").write_text('{"step": 2}')
    (tmp_path / "checkpoints" / "latest").write_text("step_000002\n")
    cfg = load_config(None, [f"run_dir={tmp_path}", "resume=true", "rollout.staleness=2"])
    with pytest.raises(
        RunDirError, match=r"rollout.staleness=2 but .*stale_weights_step_000002.pt \(the engine's"
    ):
        CheckpointManager(cfg, None, None, SimulatedStaleness(2)).resume()


COMMON = [
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    # the engine in the learner's numerics, no router noise: the only mismatch left is staleness
    "rollout.dtype=fp32",
    "log.progress_bar=false",
    "log.wandb_mode=disabled",
    "log.val_every=0",
]
RUNS = [
    ("k0", ["rollout.staleness=0", "steps=4", "checkpoint_every=0"]),
    ("k2", ["rollout.staleness=2", "steps=4", "checkpoint_every=2"]),
    ("part", ["rollout.staleness=2", "steps=2", "checkpoint_every=2"]),
    ("part", ["rollout.staleness=2", "steps=4", "checkpoint_every=2", "resume=true"]),
]


def _fingerprint(named: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _worker(rank: int, root: str) -> list[dict]:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl import dist, trainer
    from moe_rl.learner.learner import Learner
    from moe_rl.pipeline import engines  # where the trainer's engine is built

    dims, out = None, []
    real_export, real_stream, real_build = (
        Learner.export_canonical,
        Learner.iter_canonical_layers,
        engines.build_engine,
    )
    for name, overrides in RUNS:
        exports, loads = [], []

        def export(self, _exports=exports):  # = export_canonical, without passing through stream() below
            named = {n: t for c in real_stream(self) for n, t in c.items()}
            _exports.append(_fingerprint(named))
            return named

        def stream(self, _exports=exports):  # the on-policy (k = 0) sync streams the layers
            chunks = list(real_stream(self))
            _exports.append(_fingerprint({n: t for c in chunks for n, t in c.items()}))
            yield from chunks

        def build(*args, _loads=loads, **kwargs):
            engine = real_build(*args, **kwargs)
            real_load = engine.load_weights

            def load(named):
                if not isinstance(named, dict):  # a stream of per-layer chunks: join it
                    named = {n: t for chunk in named for n, t in chunk.items()}
                _loads.append(_fingerprint(named))
                return real_load(named)

            engine.load_weights = load
            return engine

        cfg = trainer.preflight(
            load_config(None, [*COMMON, *overrides, f"run_dir={root}/{name}"]), check_run_dir=False
        )
        if dims is None:
            dims = dist.init_distributed(cfg.parallel, cfg.seed)
        RouterReplay.clear_global_router_replay_instances()
        Learner.export_canonical, Learner.iter_canonical_layers, engines.build_engine = export, stream, build
        try:
            trainer.train(cfg, dims)
        finally:
            Learner.export_canonical, Learner.iter_canonical_layers, engines.build_engine = (
                real_export,
                real_stream,
                real_build,
            )
        out.append({"exports": exports, "loads": loads})
    dist.shutdown()
    return out


def _metrics(run: Path) -> dict[int, dict]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in recs}


@pytest.mark.dist
def test_engine_runs_k_steps_behind_the_learner_and_resumes_exactly(tmp_path):
    ranks = run_ranks(_worker, 2, str(tmp_path))
    assert ranks[0] == ranks[1]  # every rank exports and loads the same weights
    k0, k2, part, resumed = ranks[0]
    # load j is what step j's rollout runs on (j = 0: before step 0); export i is W_i
    assert [k0["exports"].index(f) for f in k0["loads"]] == [0, 1, 2, 3, 4]
    assert [k2["exports"].index(f) for f in k2["loads"]] == [0, 0, 0, 1, 2]  # W_max(0, t-2)
    assert len(set(k2["exports"])) == 5  # every update moved the weights
    # the resumed run restores the stale sets from its checkpoint: the same loads as uninterrupted
    assert part["loads"] == k2["loads"][:3] and resumed["loads"] == k2["loads"][2:]
    a, b, zero = _metrics(tmp_path / "k2"), _metrics(tmp_path / "part"), _metrics(tmp_path / "k0")
    assert a == b
    # each complete checkpoint has its stale weight sets beside it
    assert sorted(p.name for p in (tmp_path / "k2" / "checkpoints").iterdir()) == [
        "latest",
        "stale_weights_step_000002.pt",
        "stale_weights_step_000004.pt",
        "step_000002",
        "step_000004",
    ]
    assert [a[t]["rollout/policy_lag"] for t in range(4)] == [0.0, 1.0, 2.0, 2.0]
    # step 0 runs on the same weights and seeds whatever k is: the same step, bit for bit
    assert {k: v for k, v in a[0].items() if k != "rollout/policy_lag"} == zero[0]
    # the rollout log-probs are the stale engine's, the old pass is the current learner's: the
    # mismatch the corrections see is the policy lag, far above the synced engine's numerics
    synced = max(zero[t]["corr/k3_kl"] for t in range(4))
    for t in (1, 2, 3):
        assert a[t]["corr/k3_kl"] > 100 * synced, (t, a[t]["corr/k3_kl"], synced)
