"""A run directory's side files as the report reads them: ``config.yaml``, ``expert_load.jsonl``
(its per-expert load, line by line, skipping bad lines with one warning per problem) and the health
alarms of ``events.jsonl``. Each reader names the file (and line) in what it reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from moe_rl.errors import UserError


class ReportError(UserError):
    """A run directory that cannot be reported on; the message names the path."""


def _load_problem(rec, E: int | None, source: str) -> str | None:
    """Why one parsed expert_load.jsonl line cannot be drawn (None: it can): the format is
    {"step": int, "layers": {"<layer>": [E shares >= 0]}} (moe_rl/metrics.py log_expert_load)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec["step"], bool):
        return "not an object with an integer 'step'"
    layers = rec.get("layers")
    if not isinstance(layers, dict):
        what = ("null" if layers is None else f"a {type(layers).__name__}") if "layers" in rec else "missing"
        return f"'layers' is {what}, expected an object {{layer: [shares]}}"
    for lid, shares in layers.items():
        if not (lid.isascii() and lid.isdigit()):
            return f"layer key {lid!r} is not a layer number"
        if not isinstance(shares, list):
            return f"layer {lid}: {type(shares).__name__}, expected a list of load shares"
        if E is not None and len(shares) != E:
            return f"layer {lid} has {len(shares)} load shares, expected {E} ({source})"
        for e, v in enumerate(shares):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < math.inf):
                return f"layer {lid}: expert {e}'s share is {v!r}, expected a number >= 0"
    return None


def read_expert_load(path: Path, E: int | None) -> tuple[list[dict], list[str]]:
    """expert_load.jsonl as records by step, and warnings naming the file and its lines. A bad line
    is skipped (like an unreadable metrics.jsonl line) with one warning; lines with the same
    problem share one. ``E`` is the config's model.num_experts; without it the commonest vector
    length is the expected one. Later lines win for a repeated step."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    clean_end = lines[-1] == ""
    lines = lines[:-1] if clean_end else lines
    parsed: list[tuple[int, object]] = []
    bad: dict[str, list[int]] = {}  # problem -> line numbers (1-based)
    for i, line in enumerate(lines, start=1):
        try:
            parsed.append((i, json.loads(line)))
        except ValueError:
            cut = i == len(lines) and not clean_end
            bad.setdefault("truncated last line (killed mid-write?)" if cut else "not JSON", []).append(i)
    source = "model.num_experts"
    if E is None:  # no config: the commonest length is taken as E
        source = "the commonest length in the file; config.yaml gives no model.num_experts"
        lengths = [
            len(v)
            for _, r in parsed
            if isinstance(r, dict) and isinstance(r.get("layers"), dict)
            for v in r["layers"].values()
            if isinstance(v, list)
        ]
        E = max(set(lengths), key=lengths.count) if lengths else None
    by_step: dict[int, dict] = {}
    for i, rec in parsed:
        if (problem := _load_problem(rec, E, source)) is not None:
            bad.setdefault(problem, []).append(i)
        else:
            by_step[rec["step"]] = rec
    warnings = []
    for problem, nums in bad.items():
        shown = ", ".join(str(n) for n in nums[:5]) + (f" and {len(nums) - 5} more" if len(nums) > 5 else "")
        where = f"line {shown}" if len(nums) == 1 else f"lines {shown} ({len(nums)} of {len(lines)})"
        warnings.append(f"{path}: {where}: {problem}; skipped")
    if lines and not by_step:
        warnings.append(f"{path}: no line could be read: the per-expert load is not drawn")
    return [by_step[s] for s in sorted(by_step)], warnings


def read_run_config(cfg_path: Path) -> tuple[str, dict]:
    """A run's config.yaml as (text, mapping); ("", {}) when absent; ReportError naming the file
    (and line) when it is not UTF-8, not YAML or not a mapping."""
    if not cfg_path.is_file():
        return "", {}
    try:
        text = cfg_path.read_text(encoding="utf-8")
        config = yaml.safe_load(text) or {}
    except UnicodeDecodeError as e:
        raise ReportError(f"{cfg_path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{cfg_path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(cfg_path)
        raise ReportError(f"{where}: YAML syntax error: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ReportError(f"{cfg_path}: not a readable YAML config ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise ReportError(
            f"{cfg_path}: the top level is a {type(config).__name__}, expected the run's config mapping"
        )
    return text, config


def health_events(events_path: Path) -> list[dict]:
    """The run's health alarms (moe_rl/health.py) from events.jsonl: dicts with ``alarm``, ``step``
    and ``cause``."""
    if not events_path.is_file():
        return []
    out = []
    for line in events_path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill mid-write
        if isinstance(ev, dict) and ev.get("event") == "health":
            out.append(ev)
    return out


def health_warnings(events_path: Path) -> list[str]:
    """The run's health alarms, one warning line each."""
    return [
        f"{events_path.parent.name}: health alarm {ev.get('alarm')} at step {ev.get('step')}: "
        f"{ev.get('cause')}"
        for ev in health_events(events_path)
    ]
