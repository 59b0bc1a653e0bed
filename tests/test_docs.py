"""The docs that ship with the code: every citation in code, tests, configs, the README and the docs
pages themselves resolves.

A citation is ``docs/<name>.md`` optionally followed by section numbers (``docs/math.md 3.3``,
``docs/math.md 2.4, 9``, ``docs/gpu_stack.md 1.2-1.4``). The file must exist in the repository and
each section number must start a markdown heading of that file (``### 3.3 Masking rule``). The
team's private references are not in the repository, so a bare citation of one of them (without
the ``docs/`` prefix, or through ``shared/docs/``) is an error. The metric table of the math docs
names only keys the code emits.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCANNED = ("moe_rl", "megatron_patches", "scripts", "tests", "configs", "docs")
SCANNED_FILES = ("README.md",)  # the front page cites the docs pages too
SUFFIXES = {".py", ".yaml", ".yml", ".md", ".sh", ".toml", ".txt", ".j2"}
# the private references the code used to cite by bare name (spelled without their extension so
# this file is no citation of them)
PRIVATE = ("math", "design", "gpu_stack", "peers", "megatron_cpu", "style")

NUM = r"\d+(?:\.\d+)*"
CITATION = re.compile(
    r"(?<![\w./-])docs/(?P<name>[\w-]+)\.md(?: (?P<nums>" + NUM + r"(?:-" + NUM + r")?(?:, " + NUM + r")*))?"
)
ANY_PRIVATE = re.compile(r"(?P<name>" + "|".join(PRIVATE) + r")\.md")
VALID_PREFIX = re.compile(r"(?<![\w./-])docs/$")
HEADING = re.compile(r"^#{1,6}\s+(?P<num>" + NUM + r")\.?\s", re.MULTILINE)


def _scanned_files() -> list[Path]:
    out = []
    for d in SCANNED:
        out += [
            p
            for p in sorted((ROOT / d).rglob("*"))
            if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
        ]
    return out + [ROOT / f for f in SCANNED_FILES]


def _doc(name: str) -> Path:
    return DOCS / f"{name}.md"


def _sections(name: str) -> set[str]:
    return {m["num"] for m in HEADING.finditer(_doc(name).read_text(encoding="utf-8"))}


def _citations() -> list[tuple[str, int, str, list[str]]]:
    """(file, line, doc name, section numbers) of every docs citation in the scanned files."""
    out = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8")
        for m in CITATION.finditer(text):
            nums = [end for part in (m["nums"] or "").split(", ") if part for end in part.split("-")]
            out.append(
                (path.relative_to(ROOT).as_posix(), text.count("\n", 0, m.start()) + 1, m["name"], nums)
            )
    return out


@pytest.mark.unit
def test_docs_cite_their_own_sections_uniquely():
    for path in sorted(DOCS.glob("*.md")):
        nums = [m["num"] for m in HEADING.finditer(path.read_text(encoding="utf-8"))]
        assert nums, f"{path.name} has no numbered section"
        dupes = sorted({n for n in nums if nums.count(n) > 1})
        assert not dupes, f"{path.name}: section numbers used twice: {dupes}"


@pytest.mark.unit
def test_every_citation_resolves_to_a_file_and_section():
    cites = _citations()
    assert len(cites) >= 50  # about 100 today: a scan that finds few is broken
    problems = []
    for rel, line, name, nums in cites:
        if not _doc(name).is_file():
            problems.append(f"{rel}:{line}: docs/{name}.md does not exist")
            continue
        missing = [n for n in nums if n not in _sections(name)]
        if missing:
            problems.append(f"{rel}:{line}: docs/{name}.md has no section {missing}")
    assert not problems, "\n".join(problems)


@pytest.mark.unit
def test_no_bare_citation_of_a_private_reference():
    problems = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8")
        for m in ANY_PRIVATE.finditer(text):
            if not VALID_PREFIX.search(text[max(0, m.start() - 40) : m.start()]):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(
                    f"{path.relative_to(ROOT).as_posix()}:{line}: {text[max(0, m.start() - 20) : m.end()]!r}"
                )
    assert not problems, "cite docs/<file>.md <section> instead:\n" + "\n".join(problems)


def _metric_table() -> list[tuple[str, str]]:
    """(key, section) rows of the metric-name table (section 10 of the math docs)."""
    text = _doc("math").read_text(encoding="utf-8")
    start = re.search(r"^## 10\. ", text, re.MULTILINE)
    assert start, "math docs: no section 10 (metric names)"
    return re.findall(r"^\| `([\w/]+)` \| (" + NUM + r") \|$", text[start.end() :], re.MULTILINE)


@pytest.mark.unit
def test_metric_table_names_keys_the_code_emits():
    rows = _metric_table()
    assert len(rows) >= 30
    code = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "moe_rl").rglob("*.py")))
    sections = _sections("math")
    assert [k for k, _ in rows if f'"{k}"' not in code] == []
    assert [s for _, s in rows if s not in sections] == []
