"""Renamed config keys, kept for one release (``DEPRECATED_KEYS``): the one-line warning, the rename
of a YAML mapping, and the legacy ``correction.rs`` / ``rs_bounds`` strings as typed rejection rules."""

from __future__ import annotations

import math
import sys

from moe_rl.checks import check
from moe_rl.corrections.correction_specs import parse_rs_spec
from moe_rl.errors import ConfigError

# Renamed keys, kept for one release: old dotted key -> new key (None: removed, the value is
# ignored). correction.rs + correction.rs_bounds (strings such as '0.5_2.0') together become
# correction.rejection, a list of typed RejectionSpec, merged after every input (file, overrides).
DEPRECATED_KEYS: dict[str, str | None] = {
    **{
        f"correction.trm_{k}": f"correction.trm.{k}"
        for k in ("max", "avg", "reference", "kl", "length_neutral", "ln_threshold", "ln_eps", "ln_delta")
    },
    "correction.rs": "correction.rejection",
    "correction.rs_bounds": "correction.rejection",
    "rollout.vllm.weight_sync": None,  # transfer was its one value
}
LEGACY_RS_KEYS = ("correction.rs", "correction.rs_bounds")


def warn_deprecated(where: str, old: str, new: str | None) -> None:
    """One line on stderr; ``where`` (the file or override) tells a run's own saved config.yaml
    from what the user typed."""
    what = f"use '{new}'" if new else "removed; its value is ignored"
    print(
        f"warning: {where}: config key '{old}' is deprecated: {what} (the old key goes in the next release)",
        file=sys.stderr,
    )


def renamed_key(key: str) -> str:
    return DEPRECATED_KEYS.get(key) or key


def _covers(given: str, new: str) -> bool:
    """Whether setting the dotted key ``given`` sets (part of) ``new``: itself, a parent or a child."""
    return given == new or new.startswith(given + ".") or given.startswith((new + ".", new + "["))


def _both_given(old: str, new: str, where: str) -> ConfigError:
    return ConfigError(
        f"{where}: config keys '{old}' and '{new}' are both given, and '{old}' is the deprecated name "
        f"of '{new}': give only '{new}'"
    )


def refuse_old_and_new_overrides(overrides) -> None:
    """A deprecated key and its new name among the same command line's overrides would leave the
    last one silently winning: refused, naming both overrides."""
    keys = [(item.split("=", 1)[0].strip(), item) for item in overrides]
    for old, old_item in keys:
        new = DEPRECATED_KEYS.get(old)
        for given, item in keys:
            if new is not None and given not in DEPRECATED_KEYS and _covers(given, new):
                raise _both_given(old, new, f"overrides {old_item!r} and {item!r}")


def _has_key(tree: dict, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _refuse_old_and_new_tree(tree: dict, where: str) -> None:
    """The same check in one YAML mapping (the file ``where``)."""
    for old, new in DEPRECATED_KEYS.items():
        if new is not None and _has_key(tree, old) and _has_key(tree, new):
            raise _both_given(old, new, where)


def rename_tree(tree: dict, legacy_rs: dict, where: str) -> dict:
    """Move the deprecated keys of one YAML mapping to their new keys (one warning each); the
    rs / rs_bounds values go to ``legacy_rs`` with ``where`` they were set (merged as
    correction.rejection after every input is read)."""
    _refuse_old_and_new_tree(tree, where)
    for old, new in DEPRECATED_KEYS.items():
        head, _, leaf = old.rpartition(".")
        parent = tree
        for part in head.split("."):
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or leaf not in parent:
            continue
        value = parent.pop(leaf)
        warn_deprecated(where, old, new)
        if old in LEGACY_RS_KEYS:
            legacy_rs.update({old: value, "where": where})
        elif new is not None:
            *heads, last = new.split(".")
            node = tree
            for part in heads:
                node = node.setdefault(part, {})
            node[last] = value
    return tree


def legacy_rejection(legacy_rs: dict) -> list[dict]:
    """correction.rs + correction.rs_bounds as correction.rejection, validated as they were."""
    options = list(legacy_rs.get("correction.rs") or [])
    raw = [str(b) for b in legacy_rs.get("correction.rs_bounds") or []]
    check(bool(options) == bool(raw), "correction.rs_bounds", "give bounds exactly when rs is set")
    try:
        bounds = [tuple(float(v) for v in b.split("_")) if "_" in b else float(b) for b in raw]
        if not all(math.isfinite(v) for b in bounds for v in (b if isinstance(b, tuple) else (b,))):
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"config key 'correction.rs_bounds': {raw} are not finite numbers ('0.5_2.0' or '0.01')"
        ) from None
    try:
        parse_rs_spec(options, bounds)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config key 'correction.rs': {e}") from None
    bounds = bounds * len(options) if len(bounds) == 1 else bounds
    return [
        {"option": o, "lower": b[0], "upper": b[1]} if isinstance(b, tuple) else {"option": o, "upper": b}
        for o, b in zip(options, bounds)
    ]
