"""Rule-enforcing tests (style.md 7.2 rule 8): import boundaries and size budgets."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "moe_rl").rglob("*.py")) + sorted((ROOT / "megatron_patches").rglob("*.py"))
MAX_FUNCTION_LINES = 100


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.unit
def test_gpu_engines_imported_in_one_module_each():
    owners = {"vllm": "moe_rl/rollout/vllm_engine.py", "sglang": "moe_rl/rollout/sglang_engine.py",
              "transformer_engine": "moe_rl/learner/te_spec.py"}
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        for pkg, owner in owners.items():
            assert pkg not in _imports(path) or rel == owner, f"{rel} imports {pkg}; only {owner} may"


@pytest.mark.unit
def test_importing_the_package_has_no_megatron_side_effects():
    # `import moe_rl` / `import megatron_patches` must not patch anything (explicit apply only)
    src = (ROOT / "megatron_patches" / "__init__.py").read_text()
    tree = ast.parse(src)
    top_level_calls = [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    assert top_level_calls == []
    assert (ROOT / "moe_rl" / "__init__.py").read_text().count("import") == 0


@pytest.mark.unit
def test_function_length_budget():
    too_long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert too_long == []


@pytest.mark.unit
def test_training_loop_fits_on_one_screen():
    tree = ast.parse((ROOT / "moe_rl" / "trainer.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 60
