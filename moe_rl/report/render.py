"""Write the report: one self-contained HTML page (figures inlined as data URIs, CSS inline, no
network) and a markdown summary with its figures as PNG files beside it."""

from __future__ import annotations

import base64
import math
import os
import tempfile
from pathlib import Path

import jinja2

from moe_rl.errors import disk_full_named
from moe_rl.report import advice, data, figures, outcome
from moe_rl.report.data import Run

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("moe_rl.report", "templates"),
    # the HTML template is report.html.j2: match its full suffix (["html"] alone never matched it)
    autoescape=jinja2.select_autoescape(["html.j2"]),
    keep_trailing_newline=True,
)


def _fmt(v) -> str:
    if isinstance(v, str):
        return v
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "not logged"
    return f"{v:.4g}"


_ENV.filters["fmt"] = _fmt


def _stage(path: Path, payload: bytes) -> Path:
    """``payload`` in a temp file beside ``path`` (renamed into place by ``_write_all``)."""
    with disk_full_named(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
        except OSError:
            os.unlink(tmp)  # a full disk leaves no temp file behind
            raise
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a report is for reading
        return Path(tmp)


def _write_all(out: Path, payloads: dict[Path, bytes]) -> None:
    """Write every file of the report or none: all are staged first, then renamed into place; a
    failure (a full disk) removes the staged files and the directories this call made, so an
    earlier report in ``out`` stays as it was and no partial one is left."""
    made = [d for d in (out / "figures", *(out / "figures").parents) if not d.exists()]
    staged: list[tuple[Path, Path]] = []
    try:
        (out / "figures").mkdir(parents=True, exist_ok=True)
        for path, payload in payloads.items():
            staged.append((_stage(path, payload), path))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        for d in made:  # deepest first
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise
    for tmp, path in staged:
        os.replace(tmp, path)


def build(runs: list[Run]) -> dict:
    """Everything the templates show, figures as PNG bytes keyed by a file stem."""
    figs: list[dict] = []
    for name, title, vrange in data.PANELS:
        png = figures.heatmap(runs, name, title, vrange)
        if png is None and name == "shared_expert_share" and not any(r.has_shared_expert for r in runs):
            continue  # not "not logged": these models have no shared expert to log
        figs.append(
            {
                "stem": f"heatmap_{name}",
                "title": title,
                "kind": "heatmap",
                "png": png,
                "metric": f"router_grad/{name}/layer*",
            }
        )
    figs.append(
        {
            "stem": "heatmap_expert_load",
            "title": figures.expert_load_title(runs),
            "kind": "heatmap",
            "png": figures.expert_load(runs),
            "metric": "expert_load.jsonl",
        }
    )
    figs.append(
        {
            "stem": "mismatch_split",
            "title": figures.SPLIT_TITLE,
            "kind": "curve",
            "png": figures.mismatch_split(runs),
            "metric": "mismatch/k3_native, mismatch/k3_replayed",
        }
    )
    for key, title in data.CURVES:
        png = figures.curve(runs, key, title)
        figs.append(
            {
                "stem": "curve_" + key.replace("/", "_"),
                "title": title,
                "kind": "curve",
                "png": png,
                "metric": key,
            }
        )
    heads = [dict(data.headline(r)) for r in runs]
    verdicts = advice.run_verdicts(runs)
    labels = list(dict.fromkeys(label for h in heads for label in h))  # rows some runs lack: NaN there
    return {
        "outcomes": [outcome.outcome(r.steps_T, r.series) for r in runs],
        "outcome_definitions": outcome.DEFINITIONS,
        "runs": runs,
        "headline": [(label, [h.get(label, math.nan) for h in heads]) for label in labels],
        "verdicts": [data.layer_verdicts(r) for r in runs],
        "verdict_lines": verdict_lines(runs, verdicts),
        "problems": [found for _, found in verdicts],
        "figures": [f for f in figs if f["png"] is not None],
        "missing": [f["title"] for f in figs if f["png"] is None],
        "warnings": [w for r in runs for w in r.warnings],
        "config_diff": data.config_diff(runs) if len(runs) > 1 else [],
        "thresholds": data.THRESHOLDS,
        "window": data.WINDOW,
    }


def verdict_lines(runs: list[Run], verdicts: list[tuple[str, list]]) -> list[str]:
    """The run's verdict line; with several runs, one per run, after its name."""
    if len(runs) == 1:
        return [verdicts[0][0]]
    return [f"{r.name}: {line}" for r, (line, _) in zip(runs, verdicts)]


def default_out(run_dirs: list[str | Path], runs: list[Run]) -> Path:
    """RUN_DIR/report for one run, RUN_A/compare_<B> for two, RUN_A/compare_<N>_runs for more."""
    first = Path(run_dirs[0])
    if len(runs) == 1:
        return first / "report"
    return first / (f"compare_{runs[1].name}" if len(runs) == 2 else f"compare_{len(runs)}_runs")


def write_report(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> Path:
    """Render the report of one run, or a comparison of any number, into ``out_dir`` (default:
    ``default_out``); returns the HTML path."""
    return report_runs(run_dirs, out_dir)[0]


def report_runs(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> tuple[Path, list[str]]:
    """``write_report``, and the verdict lines it put at the top (one per run: ``verdict_lines``)."""
    runs = data.unique_names([data.load_run(p) for p in run_dirs])
    if out_dir is None:
        out_dir = default_out(run_dirs, runs)
    out = Path(out_dir)
    ctx = build(runs)
    payloads: dict[Path, bytes] = {}
    for f in ctx["figures"]:
        f["file"] = f"figures/{f['stem']}.png"
        f["data_uri"] = "data:image/png;base64," + base64.b64encode(f["png"]).decode("ascii")
        payloads[out / f["file"]] = f["png"]
    names = [r.name for r in runs]
    title = "Router stability report: " + (" vs ".join(names) if len(runs) <= 4 else f"{len(runs)} runs")
    payloads[out / "report.md"] = _ENV.get_template("report.md.j2").render(title=title, **ctx).encode()
    payloads[out / "report.html"] = _ENV.get_template("report.html.j2").render(title=title, **ctx).encode()
    _write_all(out, payloads)
    return out / "report.html", ctx["verdict_lines"]
