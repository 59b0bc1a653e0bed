"""Metrics: the value convention, the one cross-rank reduction point, and the sinks.

Convention (every producer follows it; pure math returns such dicts, nothing reduces early):

    metrics: dict[str, MetricValue], keys ``area/name[/stat]`` (units in the name, e.g.
    ``time/step_s``, ``mem/peak_gib``). A value is one of

    - ``Mean(sum, count)``: a global mean. Producers return *local* sums and counts; the
      reduction adds both over ranks (and the caller adds them over micro-batches with
      ``merge_metrics``) and only then divides, so the result is the exact global mean.
      ``count == 0`` everywhere gives NaN.
    - ``Std(sum, sum_sq, count)``: the population standard deviation of the pooled values,
      sqrt(E[x^2] - E[x]^2), reduced the same way as ``Mean``.
    - ``Sum(value)``: summed over ranks (and micro-batches).
    - ``Max(value)`` / ``Min(value)``: max / min over ranks (and micro-batches).
    - a plain number or 0-dim tensor: already global (the same on every rank, or only rank 0's
      matters, e.g. a timing); taken from the local rank as is.

    Fields are python numbers or 0-dim tensors (detached; any device). Pure math keeps them as
    tensors, so nothing syncs with the device until ``reduce_metrics`` calls ``tolist()`` once.

``reduce_metrics`` all-reduces once per step: one tiny MAX collective checks that every rank
passes the same keys and kinds, one SUM collective carries every sum and count, and one MAX
collective carries every max and every negated min. Every rank of the group must call it.

Sinks: ``MetricsWriter`` (rank 0 only) appends one JSON line per step to ``run_dir/metrics.jsonl``
(always, so ``report/`` can rebuild every figure offline) and logs to wandb unless disabled.
``read_metrics`` reads that file back and tolerates a truncated last line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist

from moe_rl.fsutil import write_atomic

logger = logging.getLogger(__name__)

Number = Union[float, int, torch.Tensor]

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
EXPERT_LOAD_FILE = "expert_load.jsonl"  # per step, per MoE layer: each routed expert's load share
WANDB_ID_FILE = "wandb_id"


@dataclass(frozen=True)
class Mean:
    """Global mean = (sum of ``sum``) / (sum of ``count``) over micro-batches and ranks."""

    sum: Number
    count: Number


@dataclass(frozen=True)
class Std:
    """Population std of the pooled values, from their ``sum``, ``sum_sq`` and ``count``."""

    sum: Number
    sum_sq: Number
    count: Number


@dataclass(frozen=True)
class Sum:
    value: Number


@dataclass(frozen=True)
class Max:
    value: Number


@dataclass(frozen=True)
class Min:
    value: Number


MetricValue = Union[Mean, Std, Sum, Max, Min, float, int, torch.Tensor]


def _merge_one(a: MetricValue, b: MetricValue, key: str) -> MetricValue:
    if type(a) is not type(b):
        raise TypeError(f"metric {key!r}: cannot merge {type(a).__name__} with {type(b).__name__}")
    if isinstance(a, Mean):
        return Mean(a.sum + b.sum, a.count + b.count)
    if isinstance(a, Std):
        return Std(a.sum + b.sum, a.sum_sq + b.sum_sq, a.count + b.count)
    if isinstance(a, Sum):
        return Sum(a.value + b.value)
    if isinstance(a, Max):
        return Max(torch.maximum(torch.as_tensor(a.value), torch.as_tensor(b.value)))
    if isinstance(a, Min):
        return Min(torch.minimum(torch.as_tensor(a.value), torch.as_tensor(b.value)))
    return b  # already global: the latest value wins


def merge_metrics(acc: dict[str, MetricValue], new: dict[str, MetricValue]) -> dict[str, MetricValue]:
    """Combine two metric dicts of the same step (e.g. two micro-batches) without reducing.

    Keys present in only one dict are kept as they are. Returns a new dict.
    """
    out = dict(acc)
    for key, value in new.items():
        out[key] = _merge_one(out[key], value, key) if key in out else value
    return out


def _kind(value: MetricValue) -> str:
    if isinstance(value, (Mean, Std, Sum, Max, Min)):
        return type(value).__name__
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"plain tensor metric must have one element, got shape {tuple(value.shape)}")
        return "Plain"
    if isinstance(value, (int, float)):
        return "Plain"
    raise TypeError(f"unsupported metric value {type(value).__name__}: use Mean/Std/Sum/Max/Min or a number")


def _comm_device(metrics: dict[str, MetricValue], group: Any) -> torch.device:
    """Where the packed vectors live: CUDA for a pure-NCCL group, else the values' own device."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    for value in metrics.values():
        fields = value.__dict__.values() if hasattr(value, "__dataclass_fields__") else (value,)
        for f in fields:
            if isinstance(f, torch.Tensor):
                return f.device
    return torch.device("cpu")


def _pack(items: list[Number], device: torch.device) -> torch.Tensor:
    if not items:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack(
        [torch.as_tensor(x, dtype=torch.float64, device=device).detach().reshape(()) for x in items]
    )


def _check_same_keys(signature: str, device: torch.device, group: Any) -> None:
    """One 2-element MAX all-reduce: every rank learns whether all ranks passed the same keys."""
    h = float(zlib.crc32(signature.encode()))  # < 2**32: exact in float64
    check = torch.tensor([h, -h], dtype=torch.float64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo = check.tolist()
    if hi != -neg_lo:
        raise RuntimeError(
            f"reduce_metrics: ranks passed different metric keys or kinds; this rank has: {signature}"
        )


def reduce_metrics(metrics: dict[str, MetricValue], group: Any = None) -> dict[str, float]:
    """Reduce a metric dict across the ranks of ``group`` (all ranks if None) into floats.

    Without an initialised process group the reduction is local. Collective: every rank of the
    group must call it with the same keys and kinds (checked; a mismatch raises on every rank).

    Returns: {key: float}, keys in sorted order.
    """
    keys = sorted(metrics)
    kinds = [_kind(metrics[k]) for k in keys]
    device = _comm_device(metrics, group)
    sums: list[Number] = []
    maxes: list[Number] = []  # maxima, then negated minima: one MAX collective serves both
    plains: list[Number] = []
    for key, kind in zip(keys, kinds):
        v = metrics[key]
        if kind == "Mean":
            sums += [v.sum, v.count]
        elif kind == "Std":
            sums += [v.sum, v.sum_sq, v.count]
        elif kind == "Sum":
            sums.append(v.value)
        elif kind == "Max":
            maxes.append(v.value)
        elif kind == "Min":
            maxes.append(-torch.as_tensor(v.value))
        else:
            plains.append(v)
    sum_vec, max_vec, plain_vec = _pack(sums, device), _pack(maxes, device), _pack(plains, device)
    if dist.is_available() and dist.is_initialized():
        _check_same_keys(",".join(f"{k}:{t}" for k, t in zip(keys, kinds)), device, group)
        if sum_vec.numel():
            dist.all_reduce(sum_vec, op=dist.ReduceOp.SUM, group=group)
        if max_vec.numel():
            dist.all_reduce(max_vec, op=dist.ReduceOp.MAX, group=group)
    flat = torch.cat([sum_vec, max_vec, plain_vec]).tolist()  # the one device sync
    return _unpack(keys, kinds, flat, len(sums), len(maxes))


def _unpack(
    keys: list[str], kinds: list[str], flat: list[float], num_sums: int, num_maxes: int
) -> dict[str, float]:
    s, m, p = (
        iter(flat[:num_sums]),
        iter(flat[num_sums : num_sums + num_maxes]),
        iter(flat[num_sums + num_maxes :]),
    )
    out: dict[str, float] = {}
    for key, kind in zip(keys, kinds):
        if kind == "Mean":
            total, count = next(s), next(s)
            out[key] = total / count if count != 0 else math.nan
        elif kind == "Std":
            total, total_sq, count = next(s), next(s), next(s)
            out[key] = (
                math.sqrt(max(total_sq / count - (total / count) ** 2, 0.0)) if count != 0 else math.nan
            )
        elif kind == "Sum":
            out[key] = next(s)
        elif kind == "Max":
            out[key] = next(m)
        elif kind == "Min":
            out[key] = -next(m)
        else:
            out[key] = next(p)
    return out


# ----------------------------------------------------------------------------- sinks


def _json_value(value: Any) -> Any:
    """Floats as JSON numbers; NaN and +-inf become null (strict JSON has no such numbers)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _parse_lines(text: str) -> tuple[list[dict], list[str], bool]:
    """Parse JSONL text. Returns (records, warnings, last_line_truncated)."""
    records: list[dict] = []
    warnings: list[str] = []
    lines = text.split("\n")
    ends_clean = text.endswith("\n") or text == ""
    if ends_clean:
        lines = lines[:-1]
    truncated = False
    for i, line in enumerate(lines):
        is_last = i == len(lines) - 1
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("not an object with an integer 'step'")
        except ValueError as err:
            if is_last and not ends_clean:
                truncated = True
                warnings.append(f"line {i + 1}: truncated last line dropped ({len(line)} chars)")
            else:
                warnings.append(f"line {i + 1}: unreadable line skipped ({err})")
            continue
        if is_last and not ends_clean:  # a complete JSON object whose newline never got written
            warnings.append(f"line {i + 1}: last line has no newline (kept)")
        records.append(rec)
    return records, warnings, truncated


def read_metrics(path: str | Path) -> tuple[list[dict], list[str]]:
    """Read a metrics.jsonl file.

    Tolerates a truncated last line (a crash mid-write) and unreadable lines, reporting each in
    the warnings. If a step appears more than once, the later line wins (with a warning).

    Returns: (records sorted by step, each a dict with "step"; human-readable warnings).
    """
    records, warnings, _ = _parse_lines(Path(path).read_text(encoding="utf-8", errors="replace"))
    by_step: dict[int, dict] = {}
    for rec in records:
        if rec["step"] in by_step:
            warnings.append(f"step {rec['step']} appears more than once; the later line is kept")
        by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)], warnings


def truncate_metrics_file(path: Path, resume_step: int) -> int:
    """Keep only the complete lines with step < resume_step (atomic rewrite). Returns lines kept."""
    if not path.exists():
        return 0
    records, warnings, _ = _parse_lines(path.read_text(encoding="utf-8", errors="replace"))
    for w in warnings:
        logger.warning("%s: %s", path, w)
    kept = [r for r in records if r["step"] < resume_step]
    if len(kept) != len(records):
        logger.info("%s: dropped %d line(s) with step >= %d", path, len(records) - len(kept), resume_step)
    write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    return len(kept)


class MetricsWriter:
    """Per-step sink: ``run_dir/metrics.jsonl`` (always) and wandb (unless ``disabled``). Rank 0 only.

    Args:
        run_dir: the run directory (created if missing).
        config_dict: the resolved config, logged to wandb as the run config.
        wandb_mode: "offline" | "online" | "disabled" ("disabled": wandb is not even imported).
        wandb_project: wandb project name.
        rank: global rank; every rank but 0 writes nothing.
        resume_step: None for a fresh run (metrics.jsonl is started empty, a new wandb id is made).
            Otherwise the first step this process will log: lines with step >= resume_step and a
            truncated last line are dropped, and the wandb run whose id is in ``run_dir/wandb_id``
            is continued (resume="allow"). wandb charts use "step" as their x axis, so re-done
            steps show up in wandb twice; metrics.jsonl has each step exactly once.
    """

    def __init__(
        self,
        run_dir: str | Path,
        config_dict: dict,
        wandb_mode: str = "offline",
        wandb_project: str = "moe-rl",
        rank: int = 0,
        resume_step: int | None = None,
    ) -> None:
        if wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb_mode {wandb_mode!r} is not one of offline|online|disabled")
        self.rank = rank
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self._file = None
        self._wandb_run = None
        if rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events_path = self.run_dir / EVENTS_FILE
        self.load_path = self.run_dir / EXPERT_LOAD_FILE
        for path in (self.path, self.events_path, self.load_path):
            if resume_step is None:
                write_atomic(path, "")
            else:
                truncate_metrics_file(path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if wandb_mode != "disabled":
            self._wandb_run = self._init_wandb(
                config_dict, wandb_mode, wandb_project, resume=resume_step is not None
            )

    def _init_wandb(self, config_dict: dict, mode: str, project: str, resume: bool) -> Any:
        import wandb  # only when used: importing it is slow and spawns nothing until init

        id_path = self.run_dir / WANDB_ID_FILE
        if resume and id_path.exists():
            run_id = id_path.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:16]
            write_atomic(id_path, run_id + "\n")
        # offline, wandb's own lines (where it writes, its closing history and sync hint) would
        # end the run's output; `moe-rl train` says where the offline run is and how to upload it
        # in its end lines instead. Online, they carry the run's URL and stay.
        settings = wandb.Settings(silent=mode == "offline")
        run = wandb.init(
            dir=str(self.run_dir),
            mode=mode,
            project=project,
            config=config_dict,
            id=run_id,
            resume="allow",
            settings=settings,
        )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one line {"step": step, **metrics} (keys sorted), flush, fsync; log to wandb."""
        if self.rank != 0:
            return
        if self._file is None:
            raise RuntimeError("MetricsWriter is closed")
        record = {k: _json_value(v) for k, v in metrics.items()}
        record["step"] = int(step)
        self._file.write(json.dumps(record, sort_keys=True, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._wandb_run is not None:
            try:
                self._wandb_run.log({**metrics, "step": int(step)})
            except Exception as e:  # noqa: BLE001 - wandb's service process is gone: the run goes on
                self._wandb_lost(step, e)

    def _wandb_lost(self, step: int, e: Exception) -> None:
        # a SIGTERM to every process of a Slurm job step (its --signal, a preemption) ends wandb's
        # service process too, while the ranks finish their step and save a checkpoint: a lost
        # wandb must not lose that checkpoint
        logger.warning(
            "wandb stopped taking metrics at step %d (%s: %s; its service process was likely "
            "signalled with the job); the run goes on, every step is in %s",
            step,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
            self.path,
        )
        self._wandb_run = None  # no finish(): it would wait on the dead service
        import wandb

        try:  # its public teardown drops wandb's exit hook first, which would print the loss again
            wandb.teardown()
        except Exception:  # noqa: BLE001, S110 - then fails on the dead service, as said above
            pass

    def log_events(self, events: list[dict]) -> None:
        """Append events (dicts with "step", e.g. an LR decay with its cause) to events.jsonl."""
        if self.rank != 0 or not events:
            return
        with open(self.events_path, "a", encoding="utf-8") as f:
            for ev in events:
                f.write(json.dumps({k: _json_value(v) for k, v in ev.items()}, sort_keys=True) + "\n")
                logger.info("event at step %s: %s", ev.get("step"), ev.get("cause", ev))
            f.flush()
            os.fsync(f.fileno())

    def log_expert_load(self, step: int, load: dict[int, list[float]]) -> None:
        """Append {"step", "layers": {MoE layer: [E load shares]}} to expert_load.jsonl (a vector
        per layer: E x L numbers, too many for metric keys at 256 experts x 58 layers)."""
        if self.rank != 0 or not load:
            return
        line = json.dumps(
            {"step": int(step), "layers": {str(k): v for k, v in load.items()}}, allow_nan=False
        )
        with open(self.load_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        """Close the file and finish the wandb run. Idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
