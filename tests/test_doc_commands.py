"""Every shell command of README.md and docs/*.md runs as written (the rule: docs/testing.md 1).

A fenced block tagged ``bash`` or ``sh`` is commands: every line but blank ones and ``#`` comments,
a line ending in ``\\`` continued by the next. In a ``console`` block only the lines after ``$ ``
are commands; the lines between them are the output the command prints, and each must appear in
it. Any other fence needs a tag (``text`` for output, ``python``, ``yaml``, ...); an untagged one
fails. An HTML comment on the line right before a block says how it is covered:

- none: ``test_doc_commands_run`` runs it (e2e tier);
- ``<!-- run: vllm -->``: ``test_doc_commands_run_on_vllm`` runs it with vLLM installed (vllm tier);
- ``<!-- exit: N -->``: it runs, and each command must exit N (an error the docs show);
- ``<!-- covered: .ci/run -->``: each command is ``bash scripts/X.sh ...`` and CI runs that script
  (``.ci/run`` itself or a script it runs); ``covered: FILE.md``: each command is a run command of
  that doc too; ``covered: tests/...py``: that test runs the command's script with its flags;
- ``<!-- not-run: gpu|slurm|hours|download: why -->``: it cannot run here.

The runs happen in a copy of the repository (commands are written from its root) with the tools
of the running Python's venv on PATH and as ``.venv``; the copy's install scripts are stubs, since
installing is CI's own step (``.ci/run``). One bash process per file, in file order, so the
commands of a file chain (train, then report, resume, export); the files share the copy, README
first. The only change to a command is SHORTEN, appended.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# The one place a documented command is changed: args appended to shorten it (the longest
# matching prefix wins; a key given twice on the command line takes the last value).
# A new run also gets a smaller batch (8 prompts x 4 samples, not the default's 32 x 8): the same
# code paths at an eighth of the rollout and update work; a resume keeps the run's saved batch.
SMALL = "rollout.prompts_per_step=8 rollout.samples_per_prompt=4"
SHORTEN = {
    "bash scripts/quickstart.sh": f"steps=2 {SMALL}",
    "moe-rl train": f"steps=2 {SMALL}",
    "moe-rl train run_dir=runs/default resume=true": "steps=4",  # after the quickstart's 2 steps
    "torchrun --nproc_per_node 2 -m moe_rl.cli train": f"steps=2 {SMALL}",
}
# Installing is CI's own step (.ci/run runs these); in the copy they only check the tools are there.
STUBBED = ("scripts/setup_env.sh", "scripts/setup_vllm_cpu.sh")
SHELL_TAGS = ("bash", "sh", "console")
NOT_RUN_REASONS = ("gpu", "slurm", "hours", "download")
MARKER = re.compile(
    r"^<!-- (?:run: (?P<run>vllm)|exit: (?P<exit>\d+)|covered: (?P<covered>\S+)"
    r"|not-run: (?P<why>" + "|".join(NOT_RUN_REASONS) + r"): \S.*) -->$"
)


@dataclass
class Command:
    doc: str  # file name relative to the repository root
    line: int  # 1-based line of the command's first line
    text: str  # the command, continuation lines joined, comment removed
    output: list[str] = field(default_factory=list)  # console blocks: lines it must print


@dataclass
class Block:
    doc: str
    line: int  # the opening fence
    marker: re.Match | None
    commands: list[Command]


def strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment: a ``#`` that starts a word outside quotes."""
    quote, prev = None, " "
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote and (quote == "'" or prev != "\\") else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and prev.isspace():
            return line[:i].rstrip()
        prev = ch
    return line.rstrip()


def _commands(doc: str, tag: str, body: list[tuple[int, str]]) -> list[Command]:
    out: list[Command] = []
    pending: Command | None = None
    for num, raw in body:
        if tag == "console" and pending is None and not raw.startswith("$ "):
            if raw.strip() and out:
                out[-1].output.append(raw.strip())
            continue
        text = raw[2:] if tag == "console" and pending is None else raw
        if pending is None and (not text.strip() or text.lstrip().startswith("#")):
            continue
        cont = text.rstrip().endswith("\\")
        part = text.rstrip()[:-1] if cont else strip_comment(text)
        start, so_far = (num, "") if pending is None else (pending.line, pending.text)
        pending = Command(doc, start, so_far + part)
        if not cont:
            out.append(Command(doc, pending.line, " ".join(pending.text.split())))
            pending = None
    return out


def parse(path: Path, root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """The shell blocks of one markdown file, and its problems (untagged fences, bad markers)."""
    doc, lines = path.relative_to(root).as_posix(), path.read_text(encoding="utf-8").split("\n")
    blocks, problems, i = [], [], 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        tag, before = fence[1], lines[i - 1].strip() if i else ""
        marker = MARKER.match(before)
        if not tag:
            problems.append(f"{doc}:{i + 1}: a fence without a tag (bash, console, text, ...)")
        elif before.startswith("<!--") and not marker:
            problems.append(f"{doc}:{i}: not a doc-test marker: {before}")
        elif tag in SHELL_TAGS:
            body = list(enumerate(lines[i + 1 : end], start=i + 2))
            blocks.append(Block(doc, i + 1, marker, _commands(doc, tag, body)))
        elif marker:
            problems.append(f"{doc}:{i}: a marker on a {tag!r} block, which is never run")
        i = end + 1
    return blocks, problems


def all_blocks() -> tuple[list[Block], list[str]]:
    blocks, problems = [], []
    for path in DOC_FILES:
        b, p = parse(path)
        blocks, problems = blocks + b, problems + p
    return blocks, problems


def _ci_scripts() -> set[str]:
    """Every script CI runs: those `bash scripts/X.sh` in .ci/run, and in them, transitively."""
    seen, todo = set(), [ROOT / ".ci" / "run"]
    while todo:
        for name in re.findall(r"\bbash (scripts/[\w.-]+\.sh)\b", todo.pop().read_text(encoding="utf-8")):
            if name not in seen:
                seen.add(name)
                todo.append(ROOT / name)
    return seen


def _run_commands(doc: str, blocks: list[Block]) -> set[str]:
    return {c.text for b in blocks if b.doc == doc and _runs_in(b) for c in b.commands}


def _runs_in(block: Block) -> str | None:
    """The test that runs ``block`` ("main" or "vllm"), None for a covered or not-run one."""
    m = block.marker
    if m is None or m["exit"]:
        return "main"
    return "vllm" if m["run"] else None


def coverage_problems(block: Block, blocks: list[Block]) -> list[str]:
    """Why a ``covered:`` block's claim does not hold (empty when it does)."""
    by, out = block.marker["covered"], []
    for c in block.commands:
        where, words = f"{c.doc}:{c.line}", c.text.split()
        if by == ".ci/run":
            if words[:1] != ["bash"] or len(words) < 2 or words[1] not in _ci_scripts():
                out.append(f"{where}: .ci/run runs no {c.text!r} (it runs {sorted(_ci_scripts())})")
        elif by.endswith(".md"):
            if c.text not in _run_commands(by, blocks):
                out.append(f"{where}: {c.text!r} is not a command {by} runs")
        elif (ROOT / by).is_file():
            test = (ROOT / by).read_text(encoding="utf-8")
            missing = [w for w in words[1:] if w.startswith(("--", "scripts/")) and w not in test]
            if missing:
                out.append(f"{where}: {by} does not run {c.text!r}: no {missing}")
        else:
            out.append(f"{where}: covered by {by!r}, which is no file")
    return out


def shortened(text: str) -> str:
    prefixes = [p for p in SHORTEN if text == p or text.startswith(p + " ")]
    return f"{text} {SHORTEN[max(prefixes, key=len)]}" if prefixes else text


@pytest.mark.unit
def test_every_shell_block_is_run_or_marked():
    blocks, problems = all_blocks()
    # a parse that finds few is broken
    assert len(blocks) >= 15 and sum(len(b.commands) for b in blocks) >= 30
    for b in blocks:
        if not b.commands:
            problems.append(f"{b.doc}:{b.line}: a shell block without a command")
        if b.marker is not None and b.marker["covered"]:
            problems += coverage_problems(b, blocks)
    assert not problems, "\n".join(problems)
    assert {_runs_in(b) for b in blocks} >= {"main", "vllm", None}


@pytest.mark.unit
def test_parser_reads_the_rules(tmp_path):
    """The parser on a known text: continuations, comments, quotes, console output, markers."""
    text = (
        "<!-- exit: 2 -->\n```console\n$ moe-rl train a=1 \\\n  b='x # y'   # why\nerror: z\n"
        "more\n```\n\n```bash\n# only a comment\nls -d .  # here\n```\n```\nuntagged\n```\n"
        "<!-- not-run: soon: x -->\n```bash\nls\n```\n"
    )
    path = tmp_path / "case.md"
    path.write_text(text, encoding="utf-8")
    blocks, problems = parse(path, tmp_path)
    assert [(b.line, b.marker["exit"] if b.marker else None) for b in blocks] == [(2, "2"), (9, None)]
    first = blocks[0].commands[0]
    assert (first.line, first.text, first.output) == (3, "moe-rl train a=1 b='x # y'", ["error: z", "more"])
    assert [(c.line, c.text) for c in blocks[1].commands] == [(11, "ls -d .")]
    assert problems == [
        "case.md:13: a fence without a tag (bash, console, text, ...)",
        "case.md:16: not a doc-test marker: <!-- not-run: soon: x -->",
    ]
    assert shortened("moe-rl train run_dir=runs/default resume=true") == (
        "moe-rl train run_dir=runs/default resume=true steps=4"
    )
    assert shortened("moe-rl trainx") == "moe-rl trainx"


def make_copy(tmp: Path) -> Path:
    """The repository as a user has it after the install: its files, and the venv as ``.venv``."""
    repo = tmp / "repo"
    ignore = shutil.ignore_patterns(".git", ".venv*", "runs", "__pycache__", "*.egg-info", ".*cache", "wandb")
    shutil.copytree(ROOT, repo, ignore=ignore)
    (repo / ".venv").symlink_to(Path(sys.prefix))
    for stub in STUBBED:  # installing is .ci/run's own step: the tools must already be there
        (repo / stub).write_text('#!/usr/bin/env bash\ntest -x "$(dirname "$0")/../.venv/bin/moe-rl"\n')
    return repo


def run_doc(repo: Path, doc: str, commands: list[tuple[Command, int]]) -> list[str]:
    """Run one file's commands in one bash process, in order; the first failure ends it."""
    logs = repo / ".doc-commands" / doc.replace("/", "_")
    logs.mkdir(parents=True)
    script = [f"cd {repo}"]
    for k, (c, code) in enumerate(commands):
        # in braces, not a subshell: `source .venv/bin/activate` holds for the next commands
        script.append(f"{{ {shortened(c.text)}\n}} >{logs}/{k}.log 2>&1")
        script.append(
            f'rc=$?; echo "{k} $rc $SECONDS" >>{logs}/rc; [ $rc = {code} ] || exit 1'
        )  # s since start
    path = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}"
    env = dict(os.environ, PATH=path, PYTHONPATH=str(repo))
    subprocess.run(["bash", "-c", "\n".join(script)], env=env, timeout=3000, check=False)
    rc_file = logs / "rc"
    done = dict(line.split()[:2] for line in rc_file.read_text().splitlines()) if rc_file.exists() else {}
    problems = []
    for k, (c, code) in enumerate(commands):
        out = (logs / f"{k}.log").read_text(errors="replace") if (logs / f"{k}.log").exists() else ""
        if str(k) not in done:
            break
        seen = {line.strip() for line in out.splitlines()}
        missing = [line for line in c.output if line not in seen]
        if done[str(k)] != str(code) or missing:
            said = [line for line in out.splitlines() if line.startswith("error:")]  # a user error's one line
            tail = "\n".join(said + [line for line in out.splitlines()[-15:] if line not in said])
            why = f"exit {done[str(k)]} (want {code})" + (f", output lacks {missing}" if missing else "")
            problems.append(f"{c.doc}:{c.line}: {why}: {shortened(c.text)}\n{tail}")
    return problems


def run_docs(tmp: Path, tier: str) -> list[str]:
    blocks, problems = all_blocks()
    assert not problems, "\n".join(problems)
    repo, problems = make_copy(tmp), []
    for doc in dict.fromkeys(b.doc for b in blocks):
        todo = [
            (c, int(b.marker["exit"]) if b.marker and b.marker["exit"] else 0)
            for b in blocks
            if b.doc == doc and _runs_in(b) == tier
            for c in b.commands
        ]
        if todo:
            problems += run_doc(repo, doc, todo)
    return problems


@pytest.mark.e2e
@pytest.mark.timeout(3000)
def test_doc_commands_run(tmp_path):
    problems = run_docs(tmp_path, "main")
    assert not problems, "\n\n".join(problems)


@pytest.mark.vllm
@pytest.mark.timeout(3000)
def test_doc_commands_run_on_vllm(tmp_path):
    if os.environ.get("MOE_RL_REQUIRE_VLLM") != "1":  # CI's vllm tier sets it: a missing vllm fails there
        pytest.importorskip("vllm")
    problems = run_docs(tmp_path, "vllm")
    assert not problems, "\n\n".join(problems)
