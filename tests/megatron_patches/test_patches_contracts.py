"""Upstream contract of every megatron patch, checked in this process without applying any.

These are the tests that fail after a megatron-core upgrade that moves, renames or re-signs a
patched callable. megatron-core is a hard dependency of the CPU test tier, so they never skip.
Nothing here applies a patch: behaviour tests run in subprocesses (test_patches_behaviour.py).
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

import megatron_patches
from megatron_patches import compat
from megatron_patches.compat import PatchError

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO_ROOT / "megatron_patches"


@pytest.mark.parametrize("name", megatron_patches.ALL_PATCHES)
def test_preconditions_hold_on_installed_megatron(name: str) -> None:
    megatron_patches.get_patch(name).check_preconditions()


def test_check_all_passes_and_names_every_patch() -> None:
    assert megatron_patches.check_all() == list(megatron_patches.ALL_PATCHES)


def test_no_patch_is_applied_in_the_test_process() -> None:
    # guards the rule that behaviour tests patch only their own subprocesses
    patches = [megatron_patches.get_patch(n) for n in megatron_patches.ALL_PATCHES]
    assert [p.NAME for p in patches if p.is_applied()] == []


def test_patch_lists_cover_every_patch_module_once() -> None:
    helpers = {"compat", "torch_proxy"}  # the guards and the scoped torch proxy the patches use
    stems = {p.stem for p in PACKAGE_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert helpers <= stems
    modules = stems - helpers
    assert sorted(megatron_patches.ALL_PATCHES) == sorted(modules)
    assert len(set(megatron_patches.ALL_PATCHES)) == len(megatron_patches.ALL_PATCHES)
    assert megatron_patches.ALWAYS_PATCHES == (
        "distopt_step_alias",
        "router_replay_hook",
        "save_results_queue",
    )


@pytest.mark.parametrize("name", megatron_patches.ALL_PATCHES)
def test_patch_module_follows_the_template(name: str) -> None:
    patch = megatron_patches.get_patch(name)
    doc = inspect.getdoc(patch) or ""
    for section in ("Target:", "Why:", "Remove when:"):
        assert section in doc, f"{name} docstring lacks {section!r}"
    assert name == patch.NAME
    assert isinstance(patch.CPU_ONLY, bool)
    SpecifierSet(patch.SUPPORTED)  # parses
    for fn in ("check_preconditions", "apply", "is_applied"):
        assert callable(getattr(patch, fn)), f"{name}.{fn}"


def test_te_names_is_only_supported_where_the_bug_exists() -> None:
    supported = SpecifierSet(megatron_patches.get_patch("te_names").SUPPORTED)
    assert "0.16.1" in supported and "0.17.0" not in supported


def test_step_alias_fix_is_not_cpu_only() -> None:
    assert not megatron_patches.get_patch("distopt_step_alias").CPU_ONLY


@pytest.mark.parametrize("name", megatron_patches.ALL_PATCHES)
def test_unsupported_megatron_version_fails_loudly(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    patch = megatron_patches.get_patch(name)
    if not getattr(patch, "needed", lambda: (True, ""))()[0]:
        # te_names on megatron-core >= 0.17 (fixed upstream) or with TE: nothing to patch, so
        # no version to check; on 0.16.x without TE (CI) it is checked like the others
        monkeypatch.setattr(compat, "MCORE_VERSION", "0.20.0")
        patch.check_preconditions()
        return
    monkeypatch.setattr(compat, "MCORE_VERSION", "0.20.0")
    with pytest.raises(PatchError, match=r"megatron-core 0\.20\.0 is installed"):
        patch.check_preconditions()


def test_changed_upstream_signature_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.transformer.moe import moe_utils

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False):  # a hypothetical upstream change
        return tensor

    monkeypatch.setattr(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    with pytest.raises(PatchError, match="maybe_move_tensor_to_cpu has parameters"):
        megatron_patches.get_patch("a2a_splits").check_preconditions()


@pytest.mark.parametrize(
    "name", [n for n in megatron_patches.ALL_PATCHES if megatron_patches.get_patch(n).CPU_ONLY]
)
def test_cpu_only_patch_refuses_cuda_build(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    patch = megatron_patches.get_patch(name)
    with pytest.raises(PatchError, match="CUDA is available"):
        patch.apply()
    assert not patch.is_applied()


def test_plan_on_cuda_applies_only_the_always_patches() -> None:
    rows = megatron_patches.plan(cuda_available=True)
    assert [r[0] for r in rows] == list(megatron_patches.ALL_PATCHES)
    assert [r[0] for r in rows if r[1]] == list(megatron_patches.ALWAYS_PATCHES)
    assert all(isinstance(reason, str) and reason for _, _, reason in rows)


def test_plan_on_cpu_applies_everything_needed() -> None:
    rows = {name: (applies, reason) for name, applies, reason in megatron_patches.plan(False)}
    te_names_needed, _ = megatron_patches.get_patch("te_names").needed()  # False with TE installed
    assert rows.pop("te_names")[0] == te_names_needed
    assert all(applies for applies, _ in rows.values()), rows


def test_import_has_no_side_effects() -> None:
    code = (
        "import sys, megatron_patches; "
        "assert 'torch' not in sys.modules, 'imports torch'; "
        "assert not any(m.startswith('megatron.') for m in sys.modules), 'imports megatron'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
