"""moe_rl.metrics: reduction (single process and 2-rank gloo), MetricsWriter, read_metrics."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_rl.metrics import (
    Max,
    Mean,
    MetricsWriter,
    Min,
    Std,
    Sum,
    merge_metrics,
    read_metrics,
    reduce_metrics,
)


@pytest.mark.unit
def test_reduce_single_process_exact():
    metrics = {
        "a/mean": Mean(torch.tensor(6.0), torch.tensor(4.0)),
        "a/std": Std(torch.tensor(2.0), 6.0, 4),  # mean 0.5, E[x^2] 1.5
        "a/sum": Sum(torch.tensor(3, dtype=torch.int64)),
        "a/max": Max(torch.tensor(2.5)),
        "a/min": Min(-1.5),
        "a/plain": 7.25,
        "a/plain_t": torch.tensor(0.5, dtype=torch.float64),
        "a/empty": Mean(torch.tensor(0.0), torch.tensor(0.0)),
    }
    got = reduce_metrics(metrics)
    assert list(got) == sorted(metrics)
    assert got["a/mean"] == 1.5 and got["a/sum"] == 3.0 and got["a/max"] == 2.5
    assert got["a/min"] == -1.5 and got["a/plain"] == 7.25 and got["a/plain_t"] == 0.5
    assert got["a/std"] == pytest.approx(math.sqrt(6 / 4 - 0.25))
    assert math.isnan(got["a/empty"])
    assert all(type(v) is float for v in got.values())


@pytest.mark.unit
def test_merge_metrics_over_microbatches():
    a = {"m": Mean(1.0, 2), "s": Sum(1), "x": Max(torch.tensor(3.0)), "n": Min(torch.tensor(0.0)), "p": 1.0}
    b = {
        "m": Mean(5.0, 2),
        "s": Sum(2),
        "x": Max(torch.tensor(4.0)),
        "n": Min(torch.tensor(-2.0)),
        "p": 2.0,
        "only_b": Sum(9),
    }
    got = reduce_metrics(merge_metrics(a, b))
    assert got == {"m": 1.5, "n": -2.0, "only_b": 9.0, "p": 2.0, "s": 3.0, "x": 4.0}
    with pytest.raises(TypeError, match="cannot merge"):
        merge_metrics({"m": Mean(1, 1)}, {"m": Sum(1)})
    with pytest.raises(TypeError, match="unsupported"):
        reduce_metrics({"bad": "text"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # rank r holds values [r*10 + i for i in range(r + 2)]: rank 0 -> 0, 1; rank 1 -> 10, 11, 12
        vals = torch.tensor([rank * 10.0 + i for i in range(rank + 2)])
        metrics = {
            "x/mean": Mean(vals.sum(), torch.tensor(float(len(vals)))),
            "x/std": Std(vals.sum(), (vals * vals).sum(), len(vals)),
            "x/sum": Sum(vals.sum()),
            "x/max": Max(vals.max()),
            "x/min": Min(vals.min()),
            "x/plain": float(rank),
        }
        result = {"ok": reduce_metrics(metrics)}
        bad = {f"y/rank{rank}": Sum(1.0)}  # same length, different keys
        try:
            reduce_metrics(bad)
            result["mismatch"] = "no error"
        except RuntimeError as err:
            result["mismatch"] = str(err)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.unit
def test_reduce_two_ranks_gloo(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    everything = torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0], dtype=torch.float64)
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        got = res["ok"]
        assert got["x/mean"] == pytest.approx(34 / 5, abs=1e-12)
        assert got["x/std"] == pytest.approx(everything.std(unbiased=False).item(), abs=1e-12)
        assert got["x/sum"] == 34.0 and got["x/max"] == 12.0 and got["x/min"] == 0.0
        assert got["x/plain"] == float(rank)  # already global: local value as is
        assert "different metric keys" in res["mismatch"]


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for var, sub in (
        ("WANDB_DIR", "wandb"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


@pytest.mark.unit
def test_writer_offline_wandb_and_resume(wandb_env):
    run_dir = wandb_env / "run"
    cfg = {"algo": {"clip_low": 0.2}, "steps": 5}
    with MetricsWriter(run_dir, cfg, wandb_mode="offline", wandb_project="t", rank=0) as w:
        for step in range(4):
            w.log(step, {"train/loss": 1.0 / (step + 1), "adv/mean": float("nan"), "time/step(s)": 0.1})
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    first = json.loads(lines[0])
    assert list(first) == sorted(first) and first["step"] == 0 and first["adv/mean"] is None
    run_id = (run_dir / "wandb_id").read_text().strip()
    assert any(p.name.endswith(run_id) for p in (run_dir / "wandb").iterdir())

    # crash mid-line, then resume from a checkpoint taken before step 2
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "train/lo')
    with MetricsWriter(run_dir, cfg, wandb_mode="offline", wandb_project="t", rank=0, resume_step=2) as w:
        for step in (2, 3, 4):
            w.log(step, {"train/loss": -float(step)})
    records, warnings = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4] and warnings == []
    assert records[1]["train/loss"] == 0.5 and records[3]["train/loss"] == -3.0
    assert (run_dir / "wandb_id").read_text().strip() == run_id  # same wandb run continued


@pytest.mark.unit
def test_writer_disabled_and_nonzero_rank(tmp_path, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    w = MetricsWriter(tmp_path / "r0", {}, wandb_mode="disabled", rank=0)
    w.log(0, {"a/b": 1.0})
    w.close()
    w.close()  # idempotent
    assert (tmp_path / "r0" / "metrics.jsonl").read_text() == '{"a/b": 1.0, "step": 0}\n'
    assert not (tmp_path / "r0" / "wandb_id").exists() and "wandb" not in sys.modules
    w1 = MetricsWriter(tmp_path / "r1", {}, wandb_mode="offline", rank=1)
    w1.log(0, {"a/b": 1.0})
    w1.close()
    assert not (tmp_path / "r1").exists()
    with pytest.raises(ValueError, match="wandb_mode"):
        MetricsWriter(tmp_path / "r2", {}, wandb_mode="cloud")


@pytest.mark.unit
def test_fresh_run_starts_empty_file(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "old": 1}\n')
    with MetricsWriter(run_dir, {}, wandb_mode="disabled") as w:
        w.log(0, {"new": 2.0})
    assert read_metrics(run_dir / "metrics.jsonl")[0] == [{"new": 2.0, "step": 0}]


@pytest.mark.unit
def test_read_metrics_reports_truncated_and_bad_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 0, "a": 1}\nnot json\n{"step": 1, "a": 2}\n{"step": 1, "a": 3}\n{"step": 2, "a"'
    )
    records, warnings = read_metrics(path)
    assert records == [{"step": 0, "a": 1}, {"step": 1, "a": 3}]
    assert len(warnings) == 3
    assert any("truncated last line" in w and "line 5" in w for w in warnings)
    assert any("line 2" in w and "unreadable" in w for w in warnings)
    assert any("step 1 appears more than once" in w for w in warnings)
    path.write_text('{"step": 0}\n{"step": 1}')  # complete JSON, newline missing: kept
    records, warnings = read_metrics(path)
    assert [r["step"] for r in records] == [0, 1] and "no newline" in warnings[0]
    path.write_text("")
    assert read_metrics(path) == ([], [])


@pytest.mark.unit
def test_expert_load_file_is_a_vector_per_layer_and_resumes_like_the_metrics(tmp_path):
    """expert_load.jsonl: one line per step with each MoE layer's E shares; a resume drops the steps
    it re-does, as in metrics.jsonl; other ranks and an empty load write nothing."""
    from moe_rl.metrics import EXPERT_LOAD_FILE

    with MetricsWriter(tmp_path, {}, wandb_mode="disabled", rank=0) as w:
        for step in range(3):
            w.log_expert_load(step, {1: [0.5 + 0.1 * step, 0.5 - 0.1 * step], 2: [1.0, 0.0]})
        w.log_expert_load(3, {})
    with MetricsWriter(tmp_path, {}, wandb_mode="disabled", rank=1) as w:
        w.log_expert_load(9, {1: [1.0, 0.0]})
    with MetricsWriter(tmp_path, {}, wandb_mode="disabled", rank=0, resume_step=2) as w:
        w.log_expert_load(2, {1: [0.25, 0.75], 2: [1.0, 0.0]})
    recs, warnings = read_metrics(tmp_path / EXPERT_LOAD_FILE)
    assert warnings == []
    assert recs == [
        {"step": 0, "layers": {"1": [0.5, 0.5], "2": [1.0, 0.0]}},
        {"step": 1, "layers": {"1": [0.6, 0.4], "2": [1.0, 0.0]}},
        {"step": 2, "layers": {"1": [0.25, 0.75], "2": [1.0, 0.0]}},
    ]


_WANDB_KILLED = """
import logging, os, signal, sys, time
from pathlib import Path
from moe_rl.metrics import MetricsWriter

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
run = Path(sys.argv[1])
w = MetricsWriter(run, {"a": 1}, wandb_mode="offline", wandb_project="t", rank=0)
w.log(0, {"x": 0.0})
me = str(os.getpid())
def parent(p):
    try:
        return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]
    except FileNotFoundError:
        return ""
kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and parent(p) == me]
assert kids, "wandb started no service process"
for pid in kids:  # as Slurm's --signal does: every process of the job step
    os.kill(pid, signal.SIGTERM)
def state(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
for pid in kids:
    while state(pid) not in ("Z", "gone"):
        time.sleep(0.05)
time.sleep(0.5)
for step in (1, 2):
    w.log(step, {"x": float(step)})
w.close()
print("closed")
"""


@pytest.mark.unit
def test_a_killed_wandb_service_costs_wandb_only(wandb_env):
    """A SIGTERM to every process of the job (Slurm's --signal, preemption) ends wandb's service
    process: the writer warns once, keeps every step in metrics.jsonl, and closes without waiting."""
    import os
    import subprocess
    import sys

    run = wandb_env / "run"
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}  # its own service, not this one's
    proc = subprocess.run(
        [sys.executable, "-c", _WANDB_KILLED, str(run)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("closed"), proc.stderr[-3000:]
    warned = [x for x in proc.stderr.splitlines() if "wandb stopped taking metrics" in x]
    assert len(warned) == 1 and "at step 1 " in warned[0] and str(run / "metrics.jsonl") in warned[0]
    assert "Traceback" not in proc.stderr  # nor at exit, from wandb's own exit hook
    records, bad = read_metrics(run / "metrics.jsonl")
    assert [r["x"] for r in records] == [0.0, 1.0, 2.0] and not bad
