"""Version, signature and attribute guards shared by every patch in ``megatron_patches``.

Each patch calls these from its ``check_preconditions()`` before touching megatron-core, so an
upgrade that renames, removes or re-signs a patched callable fails at apply time with a
``PatchError`` that names the target, instead of a ``TypeError`` deep inside the first forward.
This module imports neither torch nor megatron, so ``import megatron_patches`` stays cheap.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib import metadata
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

# Set on every replacement object (wrapper function, stub class, torch proxy, patched module),
# holding the patch name: the idempotency marker that apply() and is_applied() look for.
MARKER = "_moe_rl_patch"


class PatchError(RuntimeError):
    """A patch cannot be applied safely: wrong version, changed upstream API, or wrong device."""


def _installed_mcore_version() -> str | None:
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


MCORE_VERSION: str | None = _installed_mcore_version()


def require_version(spec: str) -> None:
    """Raise PatchError unless the installed megatron-core version is inside ``spec``.

    Args:
        spec: a PEP 440 specifier set, e.g. ">=0.16.1,<0.20".
    """
    try:
        specifier = SpecifierSet(spec)
    except InvalidSpecifier as err:
        raise PatchError(f"invalid version specifier {spec!r}: {err}") from err
    if MCORE_VERSION is None:
        raise PatchError(f"megatron-core is not installed (patch supports {spec})")
    try:
        installed = Version(MCORE_VERSION)
    except InvalidVersion as err:
        raise PatchError(f"unparsable megatron-core version {MCORE_VERSION!r}") from err
    # prereleases=True: an rc of a supported release is judged by its number, while "<0.20"
    # still excludes 0.20.0rc1 (PEP 440), so a new major line is never let in by accident.
    if not specifier.contains(installed, prereleases=True):
        raise PatchError(f"megatron-core {MCORE_VERSION} is installed, but this patch supports {spec}")


def qualified_name(obj: Any) -> str:
    """``module.QualName`` of a function, class or module, for error messages."""
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"{module}.{name}" if module and module != name else str(name)


def check_signature(fn: Callable[..., Any], expected_params: tuple[str, ...]) -> None:
    """Raise PatchError unless ``fn``'s parameter names are exactly ``expected_params``.

    ``inspect.signature`` follows ``__wrapped__``, so the check still sees the upstream
    signature after one of our wrappers has been installed over it.
    """
    try:
        actual = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as err:
        raise PatchError(f"cannot read the signature of {qualified_name(fn)}: {err}") from err
    if actual != tuple(expected_params):
        raise PatchError(
            f"{qualified_name(fn)} has parameters {list(actual)}, expected {list(expected_params)}"
        )


def check_attr(module_or_obj: Any, name: str) -> Any:
    """Raise PatchError if ``module_or_obj`` has no attribute ``name``; return the attribute."""
    try:
        return getattr(module_or_obj, name)
    except AttributeError as err:
        raise PatchError(f"{qualified_name(module_or_obj)} has no attribute {name!r}") from err


def require_no_cuda(patch_name: str) -> None:
    """Raise PatchError on a CUDA build: a CPU shim there would hide the real device."""
    import torch

    if torch.cuda.is_available():
        raise PatchError(f"patch {patch_name!r} is a CPU-only shim but CUDA is available")


def mark(obj: Any, patch_name: str) -> Any:
    """Tag a replacement object with the patch that installed it; returns ``obj``."""
    setattr(obj, MARKER, patch_name)
    return obj


def is_marked(obj: Any, patch_name: str) -> bool:
    """True if ``obj`` was installed by ``patch_name`` (see ``mark``)."""
    return getattr(obj, MARKER, None) == patch_name
