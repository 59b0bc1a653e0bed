"""Values taken as typed, never coerced: OmegaConf's typed nodes convert ``"false"``, ``yes``, 1 or 2
to a boolean and ``"4"`` to an integer, so a quoted ``"false"`` would turn a key on or off silently.
Each input layer (the YAML file, each override) is checked against the typed defaults before it
is merged: a boolean key takes true or false, an integer key an integer (not 4.6, not "4", not a
boolean), a number key an integer or a float (or inf / nan, left to the keys' own finiteness
checks, which name them). Strings are left to the keys' own validation
(``routing.replay: off`` is read as a boolean by YAML and refused there with a hint to quote it)."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode

from moe_rl.errors import ConfigError

_NON_FINITE = ("inf", "infinity", "nan")
_HINTS = {
    BooleanNode: "a boolean key takes true or false",
    IntegerNode: "an integer key takes an integer",
    FloatNode: "a number key takes an integer or a float",
}


def _taken(node: Any, value: Any) -> bool:
    if isinstance(value, str) and value.startswith("${"):
        return True  # an interpolation: OmegaConf resolves and types it
    if isinstance(node, BooleanNode):
        return isinstance(value, bool)
    if isinstance(node, IntegerNode):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, str):  # YAML spells .inf/.nan; inf and nan text reach the finiteness checks
        return value.strip().lower().lstrip("+-") in _NON_FINITE
    return isinstance(value, int | float) and not isinstance(value, bool)


def _element_base(items: ListConfig) -> Any:
    """The typed defaults of one element of a list of dataclasses (``correction.rejection``)."""
    kind = items._metadata.element_type
    return OmegaConf.structured(kind) if dataclasses.is_dataclass(kind) else None


def refuse_coercion(base: DictConfig, layer: Any, prefix: str = "") -> None:
    """ConfigError ``config key 'K': V is not ...`` for the first leaf of ``layer`` whose typed
    node in ``base`` would coerce it (the caller adds which file or override gave it)."""
    if not isinstance(layer, DictConfig):
        return
    for key in layer.keys():
        if not isinstance(base, DictConfig) or key not in base:
            continue  # unknown keys and free-form dicts: OmegaConf's own merge decides
        node, held, name = base._get_node(key), layer._get_node(key), f"{prefix}{key}"
        value = held if isinstance(held, DictConfig | ListConfig) else held._value()  # unresolved
        if isinstance(value, DictConfig):
            refuse_coercion(node, value, f"{name}.")
        elif isinstance(value, ListConfig) and isinstance(node, ListConfig):
            element = _element_base(node)
            for i, item in enumerate(value if element is not None else ()):
                refuse_coercion(element, item, f"{name}[{i}].")
        elif value is not None and type(node) in _HINTS and not _taken(node, value):
            raise ConfigError(
                f"config key '{name}': {value!r} is {type(value).__name__}, not taken as typed "
                f"({_HINTS[type(node)]}; nothing is coerced)"
            )
