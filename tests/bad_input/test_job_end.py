"""bad_input tier, issue 26: how a real `moe-rl train` job ends. Each job runs in its own session
(``start_new_session=True``) so that every process it starts (ranks, reward workers, the resource
tracker, megatron's checkpoint workers) can be listed afterwards: after Ctrl-C, SIGTERM, kill -9 of
rank 1, kill -9 of the leader and a normal end, none is left (zombies, which a container's init may
never reap, are not processes that run). A second start on the live run dir is refused naming the job; a
signal ends the job with one line that says how to resume (a first SIGTERM after the step in
progress and its checkpoint, a second SIGINT at once, issue 42); a killed rank is named.

The time from the signal to the job's end is printed (``pytest -s``), not asserted."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from moe_rl import cli
from tests.cli_helpers import ROOT, TINY, last_lines, left_in_session

LONG = ["steps=50", *TINY]  # long enough to be stopped mid-run
EVERY = "checkpoint_every=1"
MATH = ["task.reward=math", "task.reward_workers=1"]  # text rewards: a reward worker per rank


class Job:
    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.run, self.err_path, self.tmp = tmp_path / "run", tmp_path / "stderr", tmp_path / "tmp"
        self.args = [f"run_dir={self.run}", *args]
        self.tmp.mkdir()  # the job's temp dir: what it leaves there is seen (``tmp_left``)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "TMPDIR": str(self.tmp)}
        env.pop("MOE_RL_DEBUG", None)
        with open(self.err_path, "w") as err, open(tmp_path / "stdout", "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moe_rl.cli", "train", *self.args],
                stdout=out,
                stderr=err,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )

    def wait_for_first_checkpoint(self) -> None:
        latest, deadline = self.run / "checkpoints" / "latest", time.time() + 300
        while not latest.is_file():
            assert self.proc.poll() is None, self.stderr()[-3000:]
            assert time.time() < deadline
            time.sleep(0.2)

    def wait_for_steps(self, n: int) -> None:
        metrics, deadline = self.run / "metrics.jsonl", time.time() + 300
        while not metrics.is_file() or len(metrics.read_text().splitlines()) < n:
            assert self.proc.poll() is None, self.stderr()[-3000:]
            assert time.time() < deadline
            time.sleep(0.05)

    def end(self, what: str, timeout_s: float = 120) -> int:
        t0 = time.time()
        code = self.proc.wait(timeout=timeout_s)
        print(f"{what}: the job ended {time.time() - t0:.2f} s later (exit code {code})")
        return code

    def ranks(self) -> list[psutil.Process]:
        # a CPU job's ranks are children of its rank server (moe_rl/rank_server.py), the launcher's
        # child; without that server they would be the launcher's own (spawn)
        kids = psutil.Process(self.proc.pid).children()
        (server,) = [c for c in kids if "forkserver" in " ".join(c.cmdline())]
        ranks = sorted(server.children(), key=lambda c: c.pid)  # started in rank order
        assert len(ranks) == 2
        return ranks

    def stderr(self) -> str:
        return self.err_path.read_text()

    def left(self) -> list[str]:
        return left_in_session(self.proc.pid)

    def tmp_left(self, within_s: float = 5.0) -> list[str]:
        """The job's folders (moe_rl/job_tmp.py) still in its temp dir after up to ``within_s``."""
        deadline = time.time() + within_s
        while True:
            left = sorted(p.name for p in self.tmp.iterdir() if p.name.startswith("moe_rl_"))
            if not left or time.time() > deadline:
                return left
            time.sleep(0.1)

    def session(self) -> list[str]:
        ps = subprocess.run(
            ["ps", "-ww", "-o", "pid=,args=", "-s", str(self.proc.pid)],
            capture_output=True,
            text=True,
            check=False,
        )  # -ww: whole command lines (80 columns without a tty); ps exits 1 on an empty session
        return ps.stdout.splitlines()

    def hint(self, checkpointed: bool = False) -> str:
        """What the job's last line says after ``at step``: from the run dir it left
        (``checkpointed``: its last step has its checkpoint)."""
        lines = (self.run / "metrics.jsonl").read_text().splitlines()
        done = json.loads(lines[-1])["step"] + 1
        ck = int((self.run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
        assert ck == done if checkpointed else ck in (done - 1, done)  # checkpoint_every=1
        again = shlex.join(["moe-rl", "train", *self.args, "resume=true"])
        return f"at step {done}; resume with: {again}  (from the checkpoint of step {ck})"


@pytest.mark.bad_input
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_second_start_is_refused_and_a_signal_ends_the_job_cleanly(tmp_path, sig):
    """SIGINT as Ctrl-C sends it (to the whole process group), twice: the second stops the job at
    once; SIGTERM to the leader alone, once: the job ends after the step in progress, with its
    checkpoint (checkpoint_every=100: none before)."""
    every = EVERY if sig == signal.SIGINT else "checkpoint_every=100"
    job = Job(tmp_path, *LONG, every, *(MATH if sig == signal.SIGINT else []))
    try:
        job.wait_for_first_checkpoint() if sig == signal.SIGINT else job.wait_for_steps(1)
        owner = json.loads((job.run / ".lock").read_text())
        assert (owner["pid"], owner["host"]) == (job.proc.pid, socket.gethostname())
        line = (
            f"error: run_dir {job.run} is in use by pid {job.proc.pid} on host {owner['host']} since "
            f"{owner['since']}; wait for that job to end or stop it "
            f"(kill {job.proc.pid} on {owner['host']}), "
            f"or pass another run_dir=\n"
        )
        for extra in ([], ["resume=true", "steps=60"]):
            result = CliRunner().invoke(cli.main, ["train", f"run_dir={job.run}", *TINY, *extra])
            assert (result.exit_code, result.stderr) == (2, line)
        running = job.session()
        assert len(running) >= (6 if sig == signal.SIGINT else 4), running  # + a reward worker per rank
        if sig == signal.SIGINT:
            os.killpg(job.proc.pid, sig)
            while "SIGINT: finishing the step in progress" not in job.stderr():
                time.sleep(0.05)
            os.killpg(job.proc.pid, sig)  # the second: at once
        else:
            os.kill(job.proc.pid, sig)
        code = job.end(sig.name)
    finally:
        job.proc.kill()
    err = job.stderr()
    assert code == 128 + sig  # 130, 143
    asked = f"{sig.name}: finishing the step in progress and saving a checkpoint (within stop_grace_s=120 s)"
    assert last_lines(err, sig.name) == [f"{asked}; a second {sig.name} stops at once"]
    if sig == signal.SIGINT:
        assert last_lines(err, "interrupted") == [f"interrupted (SIGINT) {job.hint()}"]
        assert "stopped" not in err
    else:
        line = f"stopped (SIGTERM) after the step in progress, checkpoint saved {job.hint(checkpointed=True)}"
        assert last_lines(err, "stopped") == [line]
    assert "Traceback" not in err and "error:" not in err
    assert job.left() == []
    assert job.tmp_left() == []


@pytest.mark.bad_input
def test_a_killed_rank_is_named_and_leaves_no_process(tmp_path):
    job = Job(tmp_path, *LONG, EVERY, *MATH)
    try:
        job.wait_for_first_checkpoint()
        os.kill(job.ranks()[1].pid, signal.SIGKILL)
        code = job.end("kill -9 of rank 1")
    finally:
        job.proc.kill()
    err = job.stderr()
    assert code == 1
    # a SIGKILL is most often the OOM killer's: the line says so, and that a resume needs as much
    # host memory, not "run the same command again"
    ck_hint = job.hint().replace(
        "; resume with:",
        "; a resume holds as much host memory: free some on this node first, then resume with:",
    )
    assert last_lines(err, "error:") == [
        (
            "error: rank 1 was killed by SIGKILL, likely the kernel's out-of-memory killer: host memory ran "
            f"out (or a kill -9 from outside); the job stopped {ck_hint}"
        )
    ]
    assert "Traceback" not in err and "Connection closed by peer" not in err
    assert job.left() == []
    assert job.tmp_left() == []


@pytest.mark.bad_input
def test_a_rank_ends_what_it_started_when_its_launcher_dies(tmp_path):
    """The mechanism alone, in seconds (no megatron): a stand-in launcher, one rank, the kinds of
    process that outlived a killed launcher before; a stray SIGUSR2 is not the launcher's death."""
    out, err = tmp_path / "pids.json", tmp_path / "stderr"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(err, "w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bad_input.launcher_death", str(out)],
            stderr=err_file,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 120
        while not out.is_file():
            assert proc.poll() is None and time.time() < deadline, err.read_text()
            time.sleep(0.1)
        pids = json.loads(out.read_text())
        assert len(pids["children"]) == 2, pids  # the server, the orphan the rank inherited
        os.kill(pids["rank"], signal.SIGUSR2)  # the launcher lives: the rank goes on
        while "SIGUSR2 ignored" not in err.read_text():  # after launch.PARENT_GONE_WAIT_S
            assert time.time() < deadline, err.read_text()
            time.sleep(0.1)
        assert psutil.Process(pids["rank"]).status() != psutil.STATUS_ZOMBIE
        assert [p.pid for p in psutil.Process(pids["rank"]).children()] == pids["children"]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        t0 = time.time()
        left = left_in_session(proc.pid)
        print(f"stand-in launcher killed: its last process ended {time.time() - t0:.2f} s later")
    finally:
        proc.kill()
    assert left == []
    line = f"SIGUSR2 ignored: this rank ends on it only when its launcher (pid {proc.pid}) has died"
    assert [x for x in err.read_text().splitlines() if "SIGUSR2" in x] == [line]


@pytest.mark.bad_input
def test_kill_9_of_the_leader_leaves_no_process(tmp_path):
    """The leader cannot clean up after itself here: each rank ends its own descendants (its reward
    worker, and megatron's checkpoint writers during a save), whose end also ends the shared
    resource tracker. No rank keeps a Manager process of megatron's saver any more
    (megatron_patches/save_results_queue.py): a rank's only lasting child is its reward worker."""
    job = Job(tmp_path, *LONG, EVERY, *MATH)
    try:
        job.wait_for_first_checkpoint()
        for rank in job.ranks():  # what outlived the leader before: started by the ranks, not by it
            kids = [" ".join(c.cmdline()) for c in rank.children()]
            assert len(kids) >= 1, kids  # its reward worker (+ megatron's writers during a save)
        assert any("resource_tracker" in x for x in job.session()), job.session()
        server = [
            c.pid for c in psutil.Process(job.proc.pid).children() if "forkserver" in " ".join(c.cmdline())
        ]
        folders = {f"moe_rl_rank_exits_{server[0]}"} | {
            p.name for p in job.tmp.glob(f"moe_rl_ranks_{job.proc.pid}_*")
        }
        assert len(folders) == 2 and folders <= set(job.tmp_left(0)), job.tmp_left(
            0
        )  # the job's, named by owner
        os.kill(job.proc.pid, signal.SIGKILL)
        code = job.end("kill -9 of the leader")
        t0 = time.time()
        left = job.left()
        print(f"kill -9 of the leader: the job's last process ended {time.time() - t0:.2f} s later")
        tmp_left = job.tmp_left()  # removed by the ranks as they end (moe_rl/job_tmp.py)
    finally:
        job.proc.kill()
    assert code == -signal.SIGKILL
    assert left == []
    assert tmp_left == []
    assert "Traceback" not in job.stderr()


@pytest.mark.bad_input
def test_a_normal_end_leaves_no_process_and_frees_the_run_dir(tmp_path):
    job = Job(tmp_path, "steps=2", *MATH, *TINY)
    code = job.end("normal end", timeout_s=600)  # the whole run: 190 s at a load average of 40
    assert code == 0, job.stderr()[-3000:]
    assert job.left() == []
    assert job.tmp_left() == []
    assert len((job.run / "metrics.jsonl").read_text().splitlines()) == 2
    # the lock went with the job: the next start gets the run's own refusal, not "in use"
    result = CliRunner().invoke(cli.main, ["train", f"run_dir={job.run}", *TINY])
    assert (result.exit_code, result.stderr) == (
        2,
        (
            f"error: config key 'run_dir': {job.run} already holds a run; "
            f"pass resume=true to continue it, or another run_dir=\n"
        ),
    )
