"""The loader: embedded defaults <- one YAML file <- dotted overrides, through OmegaConf's structured
configs; ``load_config``, ``to_dict`` and ``to_yaml``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moe_rl.config.checks import _check
from moe_rl.config.correction import RejectionSpec
from moe_rl.config.deprecations import (
    _RS_KEYS,
    DEPRECATED_KEYS,
    _legacy_rejection,
    _rename_tree,
    _renamed_key,
    _warn_deprecated,
)
from moe_rl.config.run import RunConfig
from moe_rl.errors import ConfigError


def _check_rules(layer: DictConfig) -> DictConfig:
    """An unknown field of a ``correction.rejection`` rule, named with its index (OmegaConf's own
    error names the bare field only)."""
    rules = OmegaConf.select(layer, "correction.rejection", default=None)
    fields = [f.name for f in dataclasses.fields(RejectionSpec)]
    for i, rule in enumerate(rules if isinstance(rules, ListConfig) else []):
        for key in rule.keys() if isinstance(rule, DictConfig) else ():
            _check(
                key in fields, f"correction.rejection[{i}].{key}", f"not a field of a rejection rule {fields}"
            )
    return layer


def _override(base, item: str, legacy_rs: dict):
    """One ``key=value`` override as a layer to merge (None: a deprecated key held back or
    ignored). YAML 1.1 reads off/on/yes/no as booleans; a string-typed key
    (``routing.replay=off``) keeps the text as typed instead of becoming 'False', and an empty value
    (``init_weights=``, ``task.dataset=``) is the empty string, not None."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    if key.strip() in DEPRECATED_KEYS:
        old = key.strip()
        _warn_deprecated(f"override {item!r}", old, DEPRECATED_KEYS[old])
        if old in _RS_KEYS:
            value = OmegaConf.select(OmegaConf.from_dotlist([item]), old)
            legacy_rs.update(
                {
                    old: OmegaConf.to_container(value) if OmegaConf.is_config(value) else value,
                    "where": f"override {item!r}",
                }
            )
        if old in _RS_KEYS or DEPRECATED_KEYS[old] is None:
            return None
        key = DEPRECATED_KEYS[old]
        item = f"{key}={raw}"
    layer = _check_rules(OmegaConf.from_dotlist([item]))
    if isinstance(OmegaConf.select(base, key, default=None), str):
        if isinstance(OmegaConf.select(layer, key), bool) or raw.strip() == "":
            OmegaConf.update(layer, key, "" if raw.strip() == "" else raw)
    return layer


def _writable(node: Any) -> Any:
    """Clear the read-only flag on every node of ``node``; returns it.

    Frozen dataclasses make read-only nodes at every level. omegaconf 2.4's merge writes into
    them; 2.3's lifts the flag on the root only and fails on the first nested key ('Cannot set
    value of read-only config node'). The merged tree is thrown away after ``to_object``, which
    builds the frozen dataclasses again, so the result is the same on both versions."""
    if isinstance(node, DictConfig | ListConfig):
        OmegaConf.set_readonly(node, False)
        for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
            if not OmegaConf.is_missing(node, key):
                _writable(node[key])
    return node


def _read_yaml(path: str | Path):
    """A config file's top-level mapping; ConfigError naming the file (and line) otherwise."""
    import yaml

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(p)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        lines = p.read_text(errors="replace").splitlines()
        line = lines[mark.line] if mark is not None and mark.line < len(lines) else ""
        tabs = " (a tab: indent YAML with spaces)" if "\t" in line[: mark.column + 1] else ""
        raise ConfigError(f"{where}: YAML syntax error: {e.problem}{tabs}") from None
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(
            f"{path}: cannot read the YAML config ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if loaded is None:
        return {}
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(
            f"{path}: the top level is a {type(OmegaConf.to_container(loaded)).__name__}, "
            f"expected a mapping of config keys (e.g. 'steps: 100')"
        )
    return loaded


def _source_of(key: str | None, path: str | Path | None, overrides) -> str:
    """Which input set ``key``: the last override of it, else the file, else the defaults."""
    for item in reversed(list(overrides)):
        given = _renamed_key(item.split("=", 1)[0].strip())
        if key is not None and (given == key or key.startswith(given + "[")):
            return f"override {item!r}"
    return str(path) if path is not None else "defaults"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Embedded defaults <- YAML file <- dotted overrides; validated, or ConfigError naming the
    file (and line) or the override that is wrong, and the key. Deprecated keys are renamed
    (``DEPRECATED_KEYS``), one warning line each."""
    merged = _writable(OmegaConf.structured(RunConfig))
    where = "defaults"
    legacy_rs: dict = {}  # correction.rs / rs_bounds -> (value, where it was set)
    try:
        if path is not None:
            where = str(path)
            tree = _rename_tree(OmegaConf.to_container(_read_yaml(path)), legacy_rs, where)
            merged = _writable(OmegaConf.merge(merged, _check_rules(OmegaConf.create(tree))))
        base = merged
        for item in overrides:  # merged one at a time, so an error names its own override
            where = f"override {item!r}"
            layer = _override(base, item, legacy_rs)
            merged = merged if layer is None else _writable(OmegaConf.merge(merged, layer))
        if legacy_rs:  # the input that set rs or rs_bounds last is named in an error
            where = legacy_rs["where"]
            layer = OmegaConf.create({"correction": {"rejection": _legacy_rejection(legacy_rs)}})
            merged = _writable(OmegaConf.merge(merged, layer))
        where = "validation"
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        first = str(e).splitlines()[0]
        if where == "validation":
            where = _source_of(key, path, overrides)
        raise ConfigError(f"{where}: config key '{key}': {first}") from None
    except ConfigError as e:
        if not str(e).startswith("config key"):
            raise
        if where == "validation":
            key = str(e).split("'")[1]
            where = _source_of(key, path, overrides)
        if where == "defaults":
            raise
        raise ConfigError(f"{where}: {e}") from None


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
