"""Initial weights: canonical safetensors files with the architecture and tokenizer they fit.

``init_weights`` is a path, ``builtin:warmstart`` (the shipped tiny SFT checkpoint made by
``scripts/make_warmstart.py``; with ``agent.env`` set it means ``builtin:warmstart_agent``, the
one taught the compact tool-call format, ``agent_warmstart``), ``hf:DIR`` (a Hugging Face
checkpoint directory, see ``moe_rl/weights/hf.py``) or empty (megatron's random init). A file
made for another architecture or tokenizer is refused, naming the key that differs (an HF
checkpoint carries no tokenizer fingerprint: its vocabulary size is checked).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_rl.config import ARCH_FIELDS, ModelConfig, RunConfig
from moe_rl.errors import CheckpointError, ConfigError
from moe_rl.tasks.tokenizer import CharTokenizer
from moe_rl.weights.canonical import check_canonical_weights
from moe_rl.weights.stored import StoredWeights, read_header

BUILTIN = "builtin:warmstart"
BUILTIN_AGENT = "builtin:warmstart_agent"
HF_PREFIX = "hf:"
_ASSETS = {BUILTIN: "warmstart.safetensors", BUILTIN_AGENT: "warmstart_agent.safetensors"}


def builtin_path(spec: str = BUILTIN) -> Path:
    return Path(str(resources.files("moe_rl") / "assets" / _ASSETS[spec]))


def agent_warmstart(cfg: RunConfig) -> RunConfig:
    """``init_weights=builtin:warmstart`` (the default) with ``agent.env`` set is the agent warm
    start: the single-turn one never saw a tool call (docs/agentic.md 7). The resolved config
    (config.yaml, the ranks') names the file taken; any other value is kept as given."""
    if cfg.agent.env and cfg.init_weights == BUILTIN:
        return dataclasses.replace(cfg, init_weights=BUILTIN_AGENT)
    return cfg


def save_init_weights(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    model: ModelConfig,
    tok: CharTokenizer,
    info: dict | None = None,
) -> None:
    meta = {
        "model": json.dumps(dataclasses.asdict(model)),
        "tokenizer": tok.fingerprint(),
        "info": json.dumps(info or {}),
    }
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


def open_init_weights(spec: str, model: ModelConfig, tok: CharTokenizer) -> StoredWeights | None:
    """The init weights of ``spec``, checked from the file headers alone (names, shapes, dtypes,
    the architecture and tokenizer they were made for; no tensor data is read): preflight's check,
    and what each rank reads its shard from (``StoredWeights.read``, docs/design.md 2.2)."""
    if not spec:
        return None
    if spec.startswith(HF_PREFIX):
        from moe_rl.weights.hf import open_hf_checkpoint

        ckpt = Path(spec[len(HF_PREFIX) :])
        if not ckpt.is_dir():
            raise ConfigError(f"config key 'init_weights': {ckpt} is not a directory")
        return open_hf_checkpoint(ckpt, model)
    path = builtin_path(spec) if spec in _ASSETS else Path(spec)
    if not path.is_file():
        what = (
            "is a directory (a HF checkpoint directory is given as hf:DIR)"
            if path.is_dir()
            else "does not exist"
        )
        raise ConfigError(f"config key 'init_weights': {path} {what}")
    key = "config key 'init_weights': "
    tensors, meta = read_header(path, key)
    if "model" in meta:
        try:
            made_for = json.loads(meta["model"])
        except json.JSONDecodeError:
            raise CheckpointError(f"init_weights {path}: its 'model' metadata is not JSON") from None
        for field in ARCH_FIELDS:
            # a field newer than the file: the file was made with that field's default
            if made_for.get(field, ModelConfig.__dataclass_fields__[field].default) != getattr(model, field):
                raise CheckpointError(
                    f"init_weights {path} was made for model.{field}={made_for.get(field)}, "
                    f"but the config has model.{field}={getattr(model, field)}"
                )
    if "tokenizer" in meta and meta["tokenizer"] != tok.fingerprint():
        raise CheckpointError(
            f"init_weights {path} was made for another tokenizer "
            f"(fingerprint {meta['tokenizer']}, ours {tok.fingerprint()})"
        )
    try:
        check_canonical_weights(tensors, model)
    except ValueError as e:
        raise CheckpointError(f"init_weights {path}: {e}") from None
    return StoredWeights(tensors, key)


def load_init_weights(spec: str, model: ModelConfig, tok: CharTokenizer) -> dict[str, torch.Tensor] | None:
    """The whole model of ``spec`` in fp32 (tools, tests and benchmarks; a training rank reads only
    its shard, ``open_init_weights``)."""
    stored = open_init_weights(spec, model, tok)
    return None if stored is None else {k: v.float() for k, v in stored.read_all().items()}


def info(path: str | Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("info", "{}"))
