"""Rule-enforcing tests (docs/design.md 11.3): import boundaries, one-way imports and size budgets."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "moe_rl").rglob("*.py")) + sorted((ROOT / "megatron_patches").rglob("*.py"))
MAX_FUNCTION_LINES = 100
MAX_CONFIG_MODULE_LINES = 500


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
    owners = {
        "vllm": "moe_rl/rollout/vllm_engine.py",
        "sglang": "moe_rl/rollout/sglang_engine.py",
        "transformer_engine": "moe_rl/learner/te_spec.py",
    }
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        for pkg, owner in owners.items():
            assert pkg not in _imports(path) or rel == owner, f"{rel} imports {pkg}; only {owner} may"


# --------------------------------------------------------------------------------------------
# One-way imports (issue 11): the module graph of moe_rl and megatron_patches has no cycle
# --------------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in SOURCES}
PACKAGES = {name for name, p in MODULES.items() if p.name == "__init__.py"}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST):
    """Every import statement at any depth (function bodies included: a lazy import is still an
    edge), except under ``if TYPE_CHECKING:``, which never executes."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def _imported_modules(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package modules an import statement runs: ``from a.b import c`` is a.b.c when c is a
    submodule, else a.b (a package __init__, whose own imports carry its re-exports on)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    base = node.module or ""
    if node.level:
        package = module if module in PACKAGES else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}".rstrip(".")
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}


def _edges(module: str, target: str) -> set[str]:
    """``target`` and the packages above it, whose __init__ runs first; a package the importer
    itself lives in is already being imported, so it is no edge."""
    parts = target.split(".")
    chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in chain if m in MODULES and m != module and not module.startswith(m + ".")}


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        graph[name] = set()
        for node in _import_nodes(ast.parse(path.read_text())):
            for target in _imported_modules(name, node):
                graph[name] |= _edges(name, target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1 or v in graph[v]:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _path(graph: dict[str, set[str]], start: str, goal) -> list[str] | None:
    """A shortest import chain from ``start`` to a module satisfying ``goal`` (breadth first)."""
    parent: dict[str, str | None] = {start: None}
    queue = [start]
    for v in queue:
        if goal(v) and v != start:
            chain = [v]
            while parent[chain[-1]] is not None:
                chain.append(parent[chain[-1]])
            return chain[::-1]
        for w in sorted(graph[v]):
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return None


@pytest.mark.unit
def test_import_graph_has_no_cycles():
    graph = import_graph()
    assert "moe_rl.config" in graph and graph["moe_rl.trainer"], "the graph builder found no modules/edges"
    cycles = strongly_connected(graph)
    report = []
    for scc in cycles:
        members = set(scc)
        edges = [f"{a} -> {b}" for a in scc for b in sorted(graph[a] & members)]
        report.append(f"cycle of {len(scc)} modules: {', '.join(scc)}\n      " + "\n      ".join(edges))
    assert not cycles, f"{len(cycles)} import cycle(s):\n  " + "\n  ".join(report)


@pytest.mark.unit
def test_config_imports_only_pure_modules():
    # config loading stays light (no torch, megatron, vllm): it reaches the error types (issue 14),
    # the names, the rejection grammar, the layout arithmetic, the vLLM rules and the HF
    # config.json reader (init_weights=hf:DIR derives the model: section, issue 25), and nothing else
    graph = import_graph()
    own = {m for m in graph if _inside(m, "moe_rl.config")}  # the package and its modules
    assert {"moe_rl.config", "moe_rl.config.model", "moe_rl.config.loader"} <= own
    outside = set().union(*(graph[m] for m in own)) - own
    assert outside == {
        "moe_rl.errors",
        "moe_rl.checks",
        "moe_rl.names",
        "moe_rl.rejection",
        "moe_rl.layout",
        "moe_rl.rollout",
        "moe_rl.rollout.vllm_rules",
        "moe_rl.weights",
        "moe_rl.weights.hf_config",
    }
    reached, todo = set(), sorted(outside)
    while todo:
        for w in graph[todo.pop()] - reached:
            reached.add(w)
            todo.append(w)
    # and those import nothing further from the package but the file helpers (stdlib only)
    assert reached <= outside | {"moe_rl.fsutil"}
    heavy = {"torch", "megatron", "vllm", "transformer_engine", "sglang"}
    for module in outside | own | reached:
        assert not _imports(MODULES[module]) & heavy, f"{module} imports {_imports(MODULES[module]) & heavy}"
    assert graph["moe_rl.errors"] == set()


@pytest.mark.unit
def test_rollout_and_routing_do_not_reach_the_learner():
    # the learner replays routes and feeds engines; they must not depend on it, not even through
    # another module (e.g. rollout -> an HF exporter -> learner checkpoints)
    graph = import_graph()
    bad = []
    for name in sorted(graph):
        if _inside(name, "moe_rl.rollout") or _inside(name, "moe_rl.routing"):
            chain = _path(graph, name, lambda m: _inside(m, "moe_rl.learner"))
            if chain:
                bad.append(" -> ".join(chain))
    assert bad == [], "rollout/ or routing/ imports learner/:\n  " + "\n  ".join(bad)


@pytest.mark.unit
def test_only_rollout_imports_the_builtin_engines_model():
    # canonical names/shapes/checks live in moe_rl/weights/ (issue 23): the HF format, the warm
    # start and the engines share them there, not through the CPU engine's model file
    scripts = sorted((ROOT / "scripts").glob("*.py"))
    owner = "moe_rl.rollout.builtin_model"
    bad = []
    for path in SOURCES + scripts:
        name = _module_name(path)
        if _inside(name, "moe_rl.rollout"):
            continue
        for node in _import_nodes(ast.parse(path.read_text())):
            if any(_inside(t, owner) for t in _imported_modules(name, node)):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert "moe_rl.rollout.builtin" in MODULES and owner in MODULES
    assert bad == [], f"modules outside moe_rl/rollout/ import {owner}:\n  " + "\n  ".join(bad)


@pytest.mark.unit
def test_import_graph_builder_resolves_submodules_packages_and_lazy_imports():
    graph = import_graph()
    assert "moe_rl.learner.checkpoint" in graph["moe_rl.preflight"]  # from moe_rl.learner import checkpoint
    assert "moe_rl.step.correction" in graph["moe_rl.step.prepare"]  # from moe_rl.step import correction
    assert (
        "moe_rl.corrections" in graph["moe_rl.step.finalize"]
    )  # from moe_rl.corrections import ... (an __init__)
    assert "moe_rl.corrections.derived" in graph["moe_rl.corrections"]  # ... whose re-exports carry on
    assert "moe_rl.trainer" in graph["moe_rl.launch"]  # an import inside a function
    assert "megatron_patches" in graph["moe_rl.routing.replay"]  # a package's __init__ runs first
    assert "megatron_patches" not in graph["megatron_patches.a2a_splits"]  # but not for its own modules
    assert "moe_rl.types" not in graph["moe_rl.tasks.rewards"]  # under `if TYPE_CHECKING:`
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.unit
def test_reward_workers_import_no_torch():
    # the spawned reward workers import moe_rl.tasks.text_rewards: that module, the packages above
    # it and all they import must not pull torch in (it would cost each worker seconds to start)
    graph = import_graph()
    seen, todo = set(), ["moe_rl", "moe_rl.tasks", "moe_rl.tasks.text_rewards"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    assert seen == {"moe_rl", "moe_rl.tasks", "moe_rl.tasks.text_rewards"}
    assert [m for m in sorted(seen) if "torch" in _imports(MODULES[m])] == []


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
def test_config_modules_stay_small():
    # issue 23: the config package holds the tree and the loader, one job per module, none over
    # MAX_CONFIG_MODULE_LINES (the single config.py had grown to 1045 lines doing five jobs)
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "moe_rl" / "config").glob("*.py")}
    assert {"__init__.py", "model.py", "run.py", "correction.py", "loader.py"} <= set(sizes)
    assert not (ROOT / "moe_rl" / "config.py").exists()  # a stale module beside the package: ignored
    assert {n: s for n, s in sizes.items() if s > MAX_CONFIG_MODULE_LINES} == {}


@pytest.mark.unit
def test_training_loop_fits_on_one_screen():
    tree = ast.parse((ROOT / "moe_rl" / "trainer.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 60


# --------------------------------------------------------------------------------------------
# Test helpers live in helper modules (issue 31: tests/cli_helpers.py, tests/e2e/helpers.py,
# tests/hf_reference.py ...): a test module imported by another runs its module-level code twice
# and cannot be moved, split or deselected alone.


def _imported_test_modules(path: Path) -> list[str]:
    """``file:line imports MODULE`` for each import in ``path`` of a ``test_*`` module (absolute,
    relative, or a module named in ``from PACKAGE import test_x``)."""
    package = path.relative_to(ROOT).parent.parts
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) + 1 - node.level] if node.level else ()
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            # a name in the import list is a module when a file of that name is beside it
            names = [f"{module}.{a.name}" for a in node.names]
            modules = [module, *(n for n in names if (ROOT / (n.replace(".", "/") + ".py")).is_file())]
        else:
            continue
        found += [
            f"{path.relative_to(ROOT)}:{node.lineno} imports {m}"
            for m in modules
            if m.rsplit(".", 1)[-1].startswith("test_")
        ]
    return found


@pytest.mark.unit
def test_no_test_module_imports_another_test_module():
    paths = sorted((ROOT / "tests").rglob("*.py"))
    hits = [hit for path in paths for hit in _imported_test_modules(path)]
    assert hits == [], "move what they share into a helper module:\n" + "\n".join(hits)
