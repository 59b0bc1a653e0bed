"""Fault injection for the fail-fast tests (test-only: production code has no hook for it).

``python -m tests.bad_input.faults WHERE RANK KIND train [args]`` runs the real CLI, except that
each rank runs ``faulty_worker``: on rank RANK the named place raises before doing its work while
the other rank goes on into its collectives.

    startup  the learner's construction (the other rank builds its model and waits in a collective)
    step     the policy update (the other rank is inside the update's collectives)
    save     the checkpoint save (the other rank is inside the save's collectives)
    generate the rank's second ``engine.generate`` of the process (the built-in engine; with
             ``parallel.offload_during_rollout`` the learner is offloaded around it)
    stale_load  the rank's second ``engine.load_weights`` leaves ``STALE`` as it was (a load that
             skipped one tensor, raising nothing; KIND is not used): the checked sync's fault
    stale_vllm  the same on a vLLM engine: from the rank's second load on its worker is handed
             ``STALE`` as at the first (tests/vllm/helpers.py; KIND is not used)

KIND: ``bug`` raises RuntimeError (a bug: the CLI shows the rank's traceback), ``user`` raises
RouteError (a user error: one line, exit code 2), ``sigint`` sends SIGINT to the process group of
the job's session leader (Ctrl-C as a terminal sends it; start the job in its own session) and
waits inside the call for the launcher to stop the ranks. The time of the fault (time.time()) is written
to the file named by ``MOE_RL_FAULT_STAMP`` when set, so a test can time the job's end from it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

MESSAGE = "injected fault"
STALE = "model.layers.1.self_attn.o_proj.weight"


def _fault(where: str, kind: str):
    from moe_rl.errors import RouteError

    def fail(*args, **kwargs):
        stamp = os.environ.get("MOE_RL_FAULT_STAMP")
        if stamp:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
        if kind == "sigint":
            os.killpg(os.getsid(0), signal.SIGINT)  # the job's leader's group (ranks have their own)
            time.sleep(60)  # the KeyboardInterrupt arrives here, inside the offloaded generation
        if kind == "user":
            raise RouteError(f"sample 3, layer 1, row 7: {MESSAGE} at {where}")
        raise RuntimeError(f"{MESSAGE} at {where}")

    return fail


def _inject(where: str, kind: str) -> None:
    from moe_rl import checkpointing, trainer
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.rollout.vllm import engine as vllm_engine  # imports without vllm (vllm: lazily)

    places = {
        "startup": (trainer, "Learner"),
        "step": (trainer, "update_policy"),
        "save": (checkpointing.checkpoint, "save"),
        "generate": (BuiltinEngine, "generate"),
        "stale_load": (BuiltinEngine, "load_weights"),
        "stale_vllm": (vllm_engine, "sync_chunks"),
    }
    if where not in places:
        raise ValueError(f"unknown fault place {where!r}")
    module, name = places[where]
    if not hasattr(module, name):  # a rename must fail here, not as a fault that never fires
        raise AttributeError(f"{module.__name__} has no {name!r} to inject a fault into")
    if where == "generate":
        setattr(module, name, _on_second_call(getattr(module, name), _fault(where, kind)))
        return
    if where == "stale_load":
        setattr(module, name, _stale_on_second_load(getattr(module, name)))
        return
    if where == "stale_vllm":
        from tests.vllm.helpers import stale_from_second_load

        setattr(module, name, stale_from_second_load(getattr(module, name), STALE))
        return
    setattr(module, name, _fault(where, kind))


def _on_second_call(real, fail):
    calls = []

    def generate(*args, **kwargs):
        calls.append(1)
        return fail(*args, **kwargs) if len(calls) == 2 else real(*args, **kwargs)

    return generate


def _stale_on_second_load(real):
    calls = []

    def load_weights(self, *args, **kwargs):
        calls.append(1)
        if len(calls) != 2:
            return real(self, *args, **kwargs)
        old = self.held_weights()[STALE].clone()
        out = real(self, *args, **kwargs)
        self.held_weights()[STALE].copy_(old)
        stamp = os.environ.get("MOE_RL_FAULT_STAMP")
        if stamp:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
        return out

    return load_weights


def faulty_worker(cfg, where: str, rank: int, kind: str) -> None:
    from moe_rl import launch

    if int(os.environ["RANK"]) == rank:
        _inject(where, kind)
    launch.run_worker(cfg)


def main() -> None:
    from moe_rl import cli, launch

    where, rank, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    def faulty_launch(cfg, prepared=None) -> None:  # launch's own signature
        from moe_rl import stale_shm

        # as launch: the vLLM TP segments a faulted (or earlier killed) run leaves are removed
        # before and after, so they block no later vLLM TP run (moe_rl/stale_shm.py)
        stale_shm.clear()
        try:
            launch.spawn_local(faulty_worker, cfg.parallel.nproc, cfg, where, rank, kind)
        finally:
            stale_shm.clear()

    launch.launch = faulty_launch
    sys.argv = ["moe-rl", *sys.argv[4:]]
    cli.main()


if __name__ == "__main__":
    main()
