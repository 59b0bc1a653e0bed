"""The guards in megatron_patches.compat fail loudly, naming what is wrong."""

from __future__ import annotations

import types

import pytest

from megatron_patches import compat
from megatron_patches.compat import PatchError

pytestmark = pytest.mark.unit


def _upstream(self, logits, padding_mask=None):  # stands in for a patched upstream method
    return logits


def test_mcore_version_is_read_from_metadata() -> None:
    from importlib import metadata

    assert metadata.version("megatron-core") == compat.MCORE_VERSION


def test_require_version_accepts_installed_version() -> None:
    compat.require_version(f"=={compat.MCORE_VERSION}")
    compat.require_version(">=0.16.1,<0.20")


def test_require_version_raises_on_out_of_range_spec() -> None:
    with pytest.raises(PatchError) as err:
        compat.require_version("<0.1")
    assert compat.MCORE_VERSION in str(err.value)
    assert "<0.1" in str(err.value)


def test_require_version_rejects_next_major_prerelease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "MCORE_VERSION", "0.20.0rc1")
    with pytest.raises(PatchError, match=r"0\.20\.0rc1"):
        compat.require_version(">=0.16.1,<0.20")


def test_require_version_raises_on_invalid_spec() -> None:
    with pytest.raises(PatchError, match="invalid version specifier"):
        compat.require_version("about 0.16")


def test_require_version_raises_when_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "MCORE_VERSION", None)
    with pytest.raises(PatchError, match="not installed"):
        compat.require_version(">=0.16.1")


def test_check_signature_accepts_matching_parameters() -> None:
    compat.check_signature(_upstream, ("self", "logits", "padding_mask"))


def test_check_signature_raises_on_different_signature() -> None:
    with pytest.raises(PatchError) as err:
        compat.check_signature(_upstream, ("self", "logits"))
    message = str(err.value)
    assert f"{__name__}._upstream" in message  # the qualified function
    assert "['self', 'logits', 'padding_mask']" in message  # what it has
    assert "['self', 'logits']" in message  # what the patch expects


def test_check_signature_follows_wrapped() -> None:
    import functools

    @functools.wraps(_upstream)
    def wrapper(*args, **kwargs):
        return _upstream(*args, **kwargs)

    compat.check_signature(wrapper, ("self", "logits", "padding_mask"))


def test_check_signature_raises_on_unreadable_signature() -> None:
    with pytest.raises(PatchError, match="cannot read the signature"):
        compat.check_signature(iter, ())  # a builtin without a signature


def test_check_attr_returns_attribute_or_raises() -> None:
    module = types.ModuleType("fake_mod")
    module.present = 1
    assert compat.check_attr(module, "present") == 1
    with pytest.raises(PatchError, match="fake_mod has no attribute 'absent'"):
        compat.check_attr(module, "absent")


def test_require_no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    compat.require_no_cuda("x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(PatchError, match="'x' is a CPU-only shim"):
        compat.require_no_cuda("x")


def test_mark_and_is_marked() -> None:
    def fn() -> None:
        pass

    assert not compat.is_marked(fn, "p")
    assert compat.mark(fn, "p") is fn
    assert compat.is_marked(fn, "p") and not compat.is_marked(fn, "q")
