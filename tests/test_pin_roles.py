"""unit tier: MOE_RL_PIN_ROLES (moe_rl/launch.py): each local rank on its own core, one thread,
every thread of the process pinned (the learner ranks come first, so on 2 cores a 1 + 1 split puts
the learner on core 0 and the rollout rank on core 1)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe_rl.launch import pinned_core


@pytest.mark.unit
def test_pinned_core_is_round_robin_over_the_allowed_cores():
    assert [pinned_core(r, [5, 1]) for r in range(4)] == [1, 5, 1, 5]
    assert [pinned_core(r, [0, 1]) for r in range(2)] == [0, 1]  # learner rank 0, rollout rank 1


@pytest.mark.unit
def test_pin_to_core_pins_every_thread_and_runs_torch_on_one():
    cores = sorted(os.sched_getaffinity(0))
    code = (
        "import os, threading, torch, time\n"
        "from moe_rl.launch import pin_to_core\n"
        "t = threading.Thread(target=time.sleep, args=(2,)); t.start()  # a thread older than the pin\n"
        "core = pin_to_core(1)\n"
        "masks = {frozenset(os.sched_getaffinity(int(x))) for x in os.listdir('/proc/self/task')}\n"
        "print(core, sorted(next(iter(masks))) if len(masks) == 1 else masks, torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    want = cores[1 % len(cores)]
    assert out.split("\n")[0] == f"{want} [{want}] 1"
