"""The loader: embedded defaults <- one YAML file <- dotted overrides, through OmegaConf's structured
configs; ``load_config``, ``to_dict`` and ``to_yaml``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moe_rl.checks import check
from moe_rl.config.deprecations import (
    DEPRECATED_KEYS,
    LEGACY_RS_KEYS,
    legacy_rejection,
    refuse_old_and_new_overrides,
    rename_tree,
    renamed_key,
    warn_deprecated,
)
from moe_rl.config.hf_json import CONFIG as HF_CONFIG
from moe_rl.config.hf_model import load_hf_config
from moe_rl.config.run import RunConfig
from moe_rl.config.strict_types import refuse_coercion
from moe_rl.corrections.correction_specs import RejectionSpec
from moe_rl.errors import ConfigError, RunDirError


def _check_rules(layer: DictConfig) -> DictConfig:
    """An unknown field of a ``correction.rejection`` rule, named with its index (OmegaConf's own
    error names the bare field only)."""
    rules = OmegaConf.select(layer, "correction.rejection", default=None)
    fields = [f.name for f in dataclasses.fields(RejectionSpec)]
    for i, rule in enumerate(rules if isinstance(rules, ListConfig) else []):
        for key in rule.keys() if isinstance(rule, DictConfig) else ():
            check(
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
        warn_deprecated(f"override {item!r}", old, DEPRECATED_KEYS[old])
        if old in LEGACY_RS_KEYS:
            value = OmegaConf.select(OmegaConf.from_dotlist([item]), old)
            legacy_rs.update(
                {
                    old: OmegaConf.to_container(value) if OmegaConf.is_config(value) else value,
                    "where": f"override {item!r}",
                }
            )
        if old in LEGACY_RS_KEYS or DEPRECATED_KEYS[old] is None:
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
        given = renamed_key(item.split("=", 1)[0].strip())
        if key is not None and (given == key or key.startswith(given + "[")):
            return f"override {item!r}"
    return str(path) if path is not None else "defaults"


def _model_from_hf(merged, file_model_keys: set[str], path, overrides) -> tuple[DictConfig, dict[str, str]]:
    """With ``init_weights=hf:DIR`` the architecture comes from ``DIR/config.json``: its fields
    (``moe_rl/config/hf_model.py``) replace the defaults, and a ``model.*`` key the file or an
    override sets to another value is refused, naming both values. Returns the merged tree and
    which keys came from where (for the errors of validation)."""
    init = OmegaConf.select(merged, "init_weights", default="")
    hf_dir = Path(init[3:]) if isinstance(init, str) and init.startswith("hf:") else None
    if hf_dir is None or not (hf_dir / HF_CONFIG).is_file():
        return merged, {}  # no HF checkpoint (a missing one is named when weights are loaded)
    hf_path = hf_dir / HF_CONFIG
    derived = load_hf_config(hf_dir)  # CheckpointError naming the file and the key
    given = file_model_keys | {
        renamed_key(item.split("=", 1)[0].strip())[len("model.") :]
        for item in overrides
        if renamed_key(item.split("=", 1)[0].strip()).startswith("model.")
    }
    for name, value in derived.items():
        if name in given and OmegaConf.select(merged, f"model.{name}") != value:
            key = f"model.{name}"
            raise ConfigError(
                f"{_source_of(key, path, overrides)}: config key '{key}': "
                f"{OmegaConf.select(merged, key)!r} contradicts {hf_path}, which gives {value!r} "
                f"(init_weights={init}: the architecture comes from config.json; drop '{key}')"
            )
    origin = {f"model.{k}": f"{hf_path} (init_weights={init})" for k in derived if k not in given}
    return _writable(OmegaConf.merge(merged, OmegaConf.create({"model": derived}))), origin


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Embedded defaults <- YAML file <- dotted overrides, and with ``init_weights=hf:DIR`` the
    ``model:`` architecture from ``DIR/config.json`` (``_model_from_hf``); validated, or
    ConfigError naming the file (and line) or the override that is wrong, and the key. Deprecated
    keys are renamed (``DEPRECATED_KEYS``), one warning line each."""
    merged = _writable(OmegaConf.structured(RunConfig))
    where = "defaults"
    legacy_rs: dict = {}  # correction.rs / rs_bounds -> (value, where it was set)
    file_model_keys: set[str] = set()
    origin: dict[str, str] = {}  # key -> the HF config.json it was derived from
    try:
        if path is not None:
            where = str(path)
            tree = rename_tree(OmegaConf.to_container(_read_yaml(path)), legacy_rs, where)
            if isinstance(tree.get("model"), dict):
                file_model_keys = set(tree["model"])
            layer = _check_rules(OmegaConf.create(tree))
            refuse_coercion(merged, layer)
            merged = _writable(OmegaConf.merge(merged, layer))
        base = merged
        refuse_old_and_new_overrides(overrides)
        for item in overrides:  # merged one at a time, so an error names its own override
            where = f"override {item!r}"
            layer = _override(base, item, legacy_rs)
            refuse_coercion(base, layer)
            merged = merged if layer is None else _writable(OmegaConf.merge(merged, layer))
        if legacy_rs:  # the input that set rs or rs_bounds last is named in an error
            where = legacy_rs["where"]
            layer = OmegaConf.create({"correction": {"rejection": legacy_rejection(legacy_rs)}})
            merged = _writable(OmegaConf.merge(merged, layer))
        where = "init_weights"
        merged, origin = _model_from_hf(merged, file_model_keys, path, overrides)
        where = "validation"
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        first = str(e).splitlines()[0]
        if where == "validation":
            where = origin.get(str(key)) or _source_of(key, path, overrides)
        raise ConfigError(f"{where}: config key '{key}': {first}") from None
    except ConfigError as e:
        if not str(e).startswith("config key"):
            raise
        if where == "validation":
            key = str(e).split("'")[1]
            where = origin.get(key) or _source_of(key, path, overrides)
        if where == "defaults":
            raise
        raise ConfigError(f"{where}: {e}") from None


SAVED_CONFIG = "config.yaml"  # the resolved config a run writes into its run_dir (moe_rl/trainer.py)


def saved_config_missing(run_dir: Path) -> RunDirError:
    """The refusal of resume=true for a run dir with checkpoints but no saved config."""
    return RunDirError(
        f"resume=true but {run_dir / SAVED_CONFIG} is missing, so the checkpoint's model and layout "
        f"are unknown; write the config the run was started with there (moe-rl config "
        f"[CONFIG.yaml] [key=value ...] prints it)"
    )


def resume_base(overrides: list[str] | tuple[str, ...]) -> Path | None:
    """``RUN_DIR/config.yaml`` when the overrides ask to resume (``resume=true``, ``run_dir=RUN_DIR``
    or its default), else None. The two keys are read through ``load_config`` on the defaults, so a
    bad value (``resume=maybe``) gets the error it gets anywhere. RunDirError when that run has no
    saved config: nothing to resume, or a checkpoint whose model and layout are unknown."""
    flags = [i for i in overrides if renamed_key(i.split("=", 1)[0].strip()) in ("resume", "run_dir")]
    cfg = load_config(None, flags)
    if not cfg.resume:
        return None
    run_dir = Path(cfg.run_dir)
    saved = run_dir / SAVED_CONFIG
    if saved.is_file():
        return saved
    if (run_dir / "checkpoints").is_dir():
        raise saved_config_missing(run_dir)
    raise RunDirError(
        f"resume=true but {run_dir} holds no run to resume (no {SAVED_CONFIG}); drop resume=true "
        f"to start a new run"
    )


def load_run_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """What ``moe-rl train`` (and ``config``, ``estimate``) run: ``load_config(path, overrides)``,
    except that ``resume=true`` without a config file takes the run's saved ``RUN_DIR/config.yaml``
    as the file, so ``moe-rl train run_dir=RUN resume=true steps=N`` continues the run as it was
    made (an HF checkpoint's architecture included). The overrides apply on top; that they keep
    the checkpoint's shape and layout is checked when the run starts (``preflight.check_resume``).
    A file given with resume=true stays the base: an argument on the command line is never
    dropped, and the command that started a run, re-run with resume=true, keeps working."""
    if path is None:
        path = resume_base(overrides)
    return load_config(path, overrides)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
