"""e2e tier, issue 33: rollout ranks and learner ranks in one world (``parallel.rollout_ranks``,
docs/design.md 15), through the real CLI. A split sync run is the colocated run of the same learner
layout bit for bit (every metric but timings); one-step-off is deterministic, one update stale from
its second step, and resumes exactly from a checkpoint that holds the batch in flight. Both resumes
are from the checkpoint a first SIGINT saved (issue 42): the rollout ranks stop with the learner.
The EP=2 runs sample dynamically and over-sample with early abort (issue 46, docs/sampling.md 3 and
6): the learner asks the rollout ranks for each round and the groups it still lacks, the rollout rank
starts twice those and aborts the rest once enough have signal. They keep what was cut as partial
rollouts (on_abort=partial): the learner holds the pending groups and sends them with each round's
request, the rollout rank resumes them first; the split sync run is still the colocated run bit for
bit, the data cursor, the aborts and the resumed counts included, and one_step_off resumes exactly
from a checkpoint holding pending groups. (on_abort=drop on rollout ranks is the same round with
nothing pending: its learner-side decision is the colocated code, tests/step/test_oversample.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.weights.canonical import canonical_param_shapes
from tests.cli_helpers import TINY, fails_with
from tests.e2e.helpers import DYNAMIC, data_cursor, deterministic, dynamic_rounds, metrics, moe_rl, signalled

# 2 learner ranks, DP 2; a round holds 2 x 4 groups per dp rank, the pending ones first; one_step_off's
# first round is generated ahead, so what it leaves pending lags 2 versions when it trains
EP2 = ["parallel.expert_parallel=2", "checkpoint_every=0", *TINY, *DYNAMIC, "algo.over_sampling.factor=2"]
EP2 += ["algo.over_sampling.on_abort=partial", "rollout.max_staleness=2", "algo.over_sampling.check_every=1"]
SPLIT = ["parallel.nproc=4", "parallel.rollout_ranks=2"]  # + 2 rollout ranks, one per dp rank
ROLLOUT_TIMES = ("time/wait_batch_s", "time/rollout_wait_weights_s", "time/rollout_generate_s")


def _run(run: Path, *args: str) -> dict[int, dict]:
    moe_rl("train", f"run_dir={run}", *args)
    return metrics(run)


@pytest.fixture(scope="module")
def colocated_ep2(tmp_path_factory) -> dict[int, dict]:
    return _run(tmp_path_factory.mktemp("colocated") / "run", "steps=2", "parallel.nproc=2", *EP2)


def _same_as_colocated(split: dict, colocated: dict, lag: float) -> None:
    s, c = deterministic(split), deterministic(colocated)
    assert s.pop("rollout/version_lag") == lag
    for k in [k for k in s if k.startswith("weight_sync/")]:  # the broadcast's own (a split's only)
        del s[k]
    assert s == c


def _wire(run: Path) -> tuple[int, int]:
    """(bytes, chunks) of one sync of the run's model, counted here: bf16 (rollout.dtype), the
    router weight and expert bias fp32 (what the built-in engine holds them in); a chunk for the
    embedding, one per decoder layer, one for the final norm and lm_head."""
    cfg = load_config(str(run / "config.yaml"), [])
    assert cfg.rollout.dtype == "bf16"
    fp32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    shapes = canonical_param_shapes(cfg.model)
    nbytes = sum(math.prod(s) * (4 if n.endswith(fp32) else 2) for n, s in shapes.items())
    return nbytes, cfg.model.num_layers + 2


@pytest.mark.e2e
def _stopped_at(run: Path, step: int, err: str) -> None:
    """The job's last line after its first SIGINT: stopped, with the checkpoint of ``step``."""
    assert err.splitlines()[-1].startswith(
        f"stopped (SIGINT) after the step in progress, checkpoint saved at step {step}; resume with: "
    ), err[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{step:06d}"


@pytest.mark.e2e
def test_split_sync_is_the_colocated_run_bit_for_bit(tmp_path, colocated_ep2):
    # SIGINT before step 0 ends (checkpoint_every=0): step 0, its checkpoint, exit 130; then resumed
    code, err = signalled(tmp_path / "split", "steps=2", *SPLIT, *EP2, after=0)
    assert code == 130
    _stopped_at(tmp_path / "split", 1, err)
    split = _run(tmp_path / "split", "resume=true")
    assert sorted(split) == [0, 1]
    # the resume drew from the cursor step 0's rounds left (the metrics equal the colocated run's)
    assert data_cursor(tmp_path / "split", 1) == dynamic_rounds(split, 8, factor=2, partial=True)[0]
    # the rollout ranks' early abort cut responses, and step 1's rounds resumed what step 0 left
    # pending, sent by the learner across the resume's checkpoint (the counts equal the colocated run's)
    assert sum(split[t]["sampling/aborted"] for t in (0, 1)) > 0
    assert split[0]["sampling/pending"] > 0 and split[1]["sampling/resumed"] > 0
    for step in (0, 1):
        _same_as_colocated(split[step], colocated_ep2[step], lag=0.0)
        assert all(split[step][k] >= 0 for k in ROLLOUT_TIMES)
        # the step's sync (W_step+1) as learner rank 0 sent it; the other dp rank adds zeros
        rec = split[step]
        assert rec["weight_sync/version"] == step + 1
        assert (rec["weight_sync/bytes"], rec["weight_sync/chunks"]) == _wire(tmp_path / "split")
        times = ("time/weight_broadcast_wait_s", "time/weight_broadcast_s", "time/sync_s")
        assert 0 <= rec[times[0]] <= rec[times[1]] <= rec[times[2]]
    assert split[1]["time/rollout_generate_s"] > 0


@pytest.mark.e2e
def test_one_step_off_is_deterministic_one_update_stale_and_resumes_exactly(tmp_path, colocated_ep2):
    args = ["rollout.mode=one_step_off", *SPLIT, *EP2, "checkpoint_every=2"]
    full = _run(tmp_path / "full", "steps=3", *args)
    # SIGINT while step 1 runs, no checkpoint due before the last step (checkpoint_every=100):
    # the checkpoint of step 2 holds the batch of step 2 (generated ahead, with W_1)
    code, err = signalled(tmp_path / "part", "steps=3", *args, "checkpoint_every=100", after=1)
    assert code == 130
    _stopped_at(tmp_path / "part", 2, err)
    ckpts = tmp_path / "part" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "in_flight_step_000002_dp0.pt",
        "in_flight_step_000002_dp1.pt",
        "latest",
        "partials_step_000002_dp0.pt",  # algo.over_sampling's pending groups, and the batch in
        "partials_step_000002_dp1.pt",  # flight (step 2's first round) resumed some of them
        "step_000002",
    ]
    held = [torch.load(ckpts / f"partials_step_000002_dp{d}.pt", weights_only=True) for d in (0, 1)]
    assert sum(len(h["prompts"]) for h in held) > 0
    _refused_before_any_rank(tmp_path, ckpts)
    part = _run(tmp_path / "part", "steps=3", "resume=true")
    assert sorted(full) == sorted(part) == [0, 1, 2]
    for step in range(3):
        assert deterministic(full[step]) == deterministic(part[step]), f"step {step} differs after resume"
    # the step's first round was generated ahead (W_t-1: lag 1), its others with W_t (lag 0)
    assert [full[t]["rollout/version_lag"] for t in range(3)] == [0.0, 1.0, 1.0]
    rounds = dynamic_rounds(full, 8, factor=2, partial=True)
    assert part[2]["sampling/resumed"] > 0 and full[2]["sampling/resumed"] == part[2]["sampling/resumed"]
    assert sum(full[t]["sampling/aborted"] for t in range(3)) > 0  # the rollout ranks' early abort
    assert max(rounds) >= 2  # extra rounds ran (they take the next data indices, as colocated)
    # the checkpoint's cursor: past step 0's and 1's rounds and before the batch in flight
    assert data_cursor(tmp_path / "part", 2) == rounds[0] + rounds[1]
    for t in (1, 2):  # the first round's new tokens one update behind, the others' none; a partial
        # rollout's earlier tokens up to rollout.max_staleness=2 (one left pending by a first round)
        r = full[t]
        assert r["rollout/lag_max"] <= 2 and (rounds[t] > 1 or r["rollout/lag_frac/0"] == 0), t
    # step 0 is generated with W_0 as in the sync run; step 1's batch too (W_0, one update stale):
    # the same prompts, scored against a learner one update ahead, so the mismatch is the update's:
    # its tokens one update behind against the sync run's tokens of the current weights (the sync
    # run's step 1 trains partials of step 0 too: they lag 1 there)
    _same_as_colocated(full[0], colocated_ep2[0], lag=0.0)
    assert full[1]["rollout/num_seqs"] == colocated_ep2[1]["rollout/num_seqs"] == 32.0
    assert full[1]["mismatch/k3_lag1"] > 10 * colocated_ep2[1]["mismatch/k3_lag0"]


def _refused_before_any_rank(tmp_path: Path, ckpts: Path) -> None:
    """Issue 42.3 on the real checkpoint: the launcher's preflight refuses another rollout.mode and
    a truncated in-flight file, in-process (no rank starts), the disk unchanged (the rest of the
    refusals: tests/bad_input/test_resume_refusals.py)."""
    run, resume = ckpts.parent, ("train", f"run_dir={ckpts.parent}", "steps=3", "resume=true")
    fails_with(
        tmp_path,
        f"resume=true: rollout.mode=sync but the run in {run} was made with rollout.mode=one_step_off "
        f"({run}/config.yaml); a checkpoint cannot change it: use rollout.mode=one_step_off or a new "
        f"run_dir=",
        *resume,
        "rollout.mode=sync",
    )
    fails_with(  # the batch in flight holds the rollout rank's round of 2 x the step's groups
        tmp_path,
        f"resume=true: algo.over_sampling.factor=3.0 but the run in {run} was made with "
        f"algo.over_sampling.factor=2.0 ({run}/config.yaml); a checkpoint cannot change it: use "
        f"algo.over_sampling.factor=2.0 or a new run_dir=",
        *resume,
        "algo.over_sampling.factor=3",
    )
    dp1 = ckpts / "in_flight_step_000002_dp1.pt"
    whole = dp1.read_bytes()
    dp1.write_bytes(whole[:-100])
    fails_with(
        tmp_path,
        f"{dp1} (the batches in flight, rollout.mode=one_step_off) is truncated or corrupt: the checkpoint "
        f"in {ckpts} cannot be resumed; resume from another step (point {ckpts / 'latest'} at it)",
        *resume,
    )
    dp1.write_bytes(whole)


@pytest.mark.e2e
def test_split_sync_with_a_tp2_learner_is_the_colocated_tp2_run(tmp_path):
    """The split run checks its syncs (rollout.sync_check, issue 45.3): the rollout rank's engine
    scores the probe batch after each load against the learner's log-probs of the same weights and
    sends the k3 with its batch; the check changes nothing else (the unchecked colocated run)."""
    tp2 = ["steps=2", "parallel.tensor_parallel=2", "parallel.expert_parallel=1", "checkpoint_every=0", *TINY]
    tp2 += ["rollout.dtype=fp32"]  # the fp32 engine: the probe's k3 is rounding alone
    colocated = _run(tmp_path / "colocated", "parallel.nproc=2", *tp2)
    split = _run(
        tmp_path / "split", "parallel.nproc=3", "parallel.rollout_ranks=1", "rollout.sync_check=true", *tp2
    )
    cfg = load_config(str(tmp_path / "split" / "config.yaml"), [])
    for step in (0, 1):  # one rollout rank serves the one dp rank: both TP ranks get its batch
        rec = dict(split[step])
        # step t's batch was generated with W_t (the first sync's W_0 at step 0): its probe too;
        # measured 5.6e-14 and 1.4e-13 (fp32 engine vs the TP=2 learner: summation order alone)
        assert rec.pop("sync/probe_version") == step
        assert 0 <= rec.pop("sync/probe_k3") < 1e-9
        # the built-in engine holds the canonical tensors: every one of them agreed
        assert rec.pop("sync/check_tensors") == len(canonical_param_shapes(cfg.model))
        _same_as_colocated(rec, colocated[step], lag=0.0)
