"""slurm tier (issue 43): scripts/slurm_train.sbatch submitted to a real Slurm (Debian's slurm-wlm
22.05 and munge: slurmctld and slurmd on this host, scripts/slurm_local.sh), 2 CPU ranks on the one
node. Skipped where slurm-wlm is not installed or the tests are not root (the daemons run as root);
.ci/run installs it and runs this tier on its own."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import DEFAULT_4_STEPS, deterministic, metrics

ROOT = Path(__file__).resolve().parents[2]
NEEDS = "needs slurm-wlm and munge (apt-get install slurm-wlm munge) and root"
MISSING = shutil.which("slurmctld") is None or shutil.which("munged") is None or os.geteuid() != 0
REQUIRED = os.environ.get("MOE_RL_REQUIRE_SLURM") == "1"  # scripts/test_slurm.sh: fail, not skip
# the slurm tier's own (scripts/test_slurm.sh, a CI stage): not again in the main suite where
# Slurm happens to be installed
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not REQUIRED, reason=f"the slurm tier's: bash scripts/test_slurm.sh ({NEEDS})"),
]


def _free_pair() -> int:
    """A port that is free with the next one (slurmctld's and slurmd's)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


def _running(pid: int) -> bool:
    try:  # a zombie has ended: only its parent's wait is left
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-host cluster for this module: its environment for sbatch/squeue/sacct."""
    assert not MISSING, NEEDS
    d = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURM_PORT": str(_free_pair()), "SLURM_CONF": str(d / "slurm.conf")}
    local = ["bash", str(ROOT / "scripts" / "slurm_local.sh")]
    subprocess.run([*local, "start", str(d)], env=env, check=True, timeout=60)
    pidfiles = [d / "slurmctld.pid", d / "slurmd.pid", d / "munge" / "munged.pid"]
    pids = [int(p.read_text()) for p in pidfiles]
    try:
        yield env
    finally:
        subprocess.run([*local, "stop", str(d)], env=env, check=True, timeout=60)
        running = [pid for pid in pids if _running(pid)]
        assert running == [], f"daemons left running after stop: {running}"


def sbatch(env: dict, out: Path, *args: str, wait: bool = True) -> str:
    """Submit the project's sbatch script with 2 CPU ranks on the node; the job id."""
    threads = str(max(1, (os.cpu_count() or 1) // 2))  # as `moe-rl train`'s 2 local ranks run
    export = f"ALL,GPUS_PER_NODE=2,OMP_NUM_THREADS={threads},PYTHON={sys.executable}"
    cmd = [
        "sbatch",
        "--parsable",
        "--gpus-per-node=0",
        "--cpus-per-task=2",
        f"--output={out}",
        f"--export={export}",
    ]
    cmd += ["--wait"] if wait else []
    proc = subprocess.run(
        [*cmd, str(ROOT / "scripts" / "slurm_train.sbatch"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 or not wait, f"{proc.stderr}\n{out.read_text() if out.exists() else ''}"
    return proc.stdout.strip().split(";")[0]


def job_state(env: dict, job: str) -> tuple[str, str]:
    """(State, ExitCode) from the job-completion file (`sacct -c`: no slurmdbd here)."""
    for _ in range(50):  # the job-completion record is written as the job ends
        row = subprocess.run(
            ["sacct", "-c", "-j", job, "-n", "-P", "-o", "state,exitcode"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if row:
            return tuple(row[0].split("|"))
        time.sleep(0.1)
    raise AssertionError(f"sacct -c has no record of job {job}")


def test_sbatch_trains_on_a_real_slurm(tmp_path, slurm):
    run, out = tmp_path / "run", tmp_path / "job.out"
    job = sbatch(slurm, out, f"run_dir={run}", "steps=2", "log.progress_bar=false")
    assert job_state(slurm, job) == ("COMPLETED", "0:0")
    log = out.read_text()
    assert f"moe-rl: 1 nodes x 2 ranks, rendezvous {socket.gethostname()}:" in log
    assert f"run finished: 2 steps in {run}" in log
    assert sorted(metrics(run)) == [0, 1]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_sigterm_checkpoints_and_a_second_job_resumes_exactly(tmp_path, slurm, default_run):
    """As the time limit's --signal=TERM@180 does: scancel --signal=TERM signals the job step."""
    full, _ = default_run
    run, out = tmp_path / "run", tmp_path / "job.out"
    args = [a for a in DEFAULT_4_STEPS if not a.startswith("steps=")]
    job = sbatch(slurm, out, f"run_dir={run}", "steps=20", *args, wait=False)
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline, out.read_text()
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm, check=True)
    while subprocess.run(
        ["squeue", "-h", "-j", job], env=slurm, capture_output=True, text=True
    ).stdout.strip():
        assert time.monotonic() < deadline, out.read_text()
        time.sleep(0.2)
    state = job_state(slurm, job)
    assert "stopped (SIGTERM) after the step in progress, checkpoint saved" in out.read_text(), state
    ck = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert 1 <= ck <= 3, f"checkpoint of step {ck}: the stop came too late to test the resume"
    resumed = sbatch(slurm, tmp_path / "resume.out", f"run_dir={run}", "steps=4", "resume=true")
    assert job_state(slurm, resumed) == ("COMPLETED", "0:0")
    a, b = metrics(full), metrics(run)
    assert sorted(b) == [0, 1, 2, 3]
    for step in range(4):
        assert deterministic(a[step]) == deterministic(b[step]), (
            f"step {step} differs after the SIGTERM resume"
        )
