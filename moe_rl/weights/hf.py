"""Hugging Face checkpoints in and out: ``config.json`` + (sharded) safetensors of the Qwen3-MoE,
Mixtral, DeepSeek-V3 (and Kimi-K2), GLM-4.5 and Qwen2-MoE families.

Canonical weight names are HF Qwen3-MoE's plus DeepSeek-V3's (``weights/canonical.py``;
``weights/megatron_shards.py`` maps them to megatron and back for every EP/TP/PP layout). Other
families are renamed here, at the file boundary only, by one small table per family
(``config/hf_model.py`` ``FAMILIES``, keyed by ``model_type`` == ``ModelConfig.hf_family``, which
also maps config.json onto the typed fields): Mixtral's ``block_sparse_moe.gate`` is ``mlp.gate``
and its experts' ``w1``/``w3``/``w2`` are ``gate_proj``/``up_proj``/``down_proj``; Qwen2-MoE's
``mlp.shared_expert.*`` are ``mlp.shared_experts.*``. This module owns the file formats and the
strict checks (docs/design.md 9; issue 7).

- ``load_hf_config`` (config/hf_model.py): config.json -> ModelConfig fields; anything the learner cannot
  represent exactly is refused, naming the key and the file.
- ``hf_weight_index``: the index and the shard headers (``weights/stored.py``, no tensor data read);
  ``read_hf_weights`` reads what it lists, one tensor at a time; every expected tensor must be
  present with its shape and nothing else may be there, except a DeepSeek-V3 / GLM-4.5 checkpoint's
  MTP layers (``num_nextn_predict_layers``), skipped with one log line; errors name the tensor and
  the file.
- ``write_hf_checkpoint``: shards + ``model.safetensors.index.json`` + ``config.json`` written into
  a temporary sibling directory, fsynced and renamed, so a crash never leaves a half checkpoint.
  The expert bias ``e_score_correction_bias`` is written in fp32 whatever the export dtype (the
  DeepSeek-V3 hub stores it so: its entries differ by less than a bf16 step).

File formats only: no learner, no launcher, so the vLLM engine imports it freely. Exporting a run
(``moe-rl export-hf``: a run's dist checkpoint loaded by the learner -> HF) is ``moe_rl/export.py``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moe_rl.config import ARCH_FIELDS, ModelConfig
from moe_rl.config.hf_json import CONFIG
from moe_rl.config.hf_model import (  # noqa: F401 (re-exported: the HF format's one module)
    FAMILIES,
    MODEL_TYPE_ALIASES,
    SUPPORTED_MODEL_TYPES,
    Family,
    family_problem,
    load_hf_config,
    model_fields_from_hf,
    mtp_layers,
)
from moe_rl.errors import CheckpointError
from moe_rl.fsutil import fsync_path, open_safetensors, read_json
from moe_rl.weights.canonical import canonical_param_shapes
from moe_rl.weights.hf_config import hf_config_dict as _hf_config_dict
from moe_rl.weights.stored import StoredTensor, StoredWeights, read_header

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def family_of(cfg: ModelConfig) -> Family:
    """``cfg``'s HF family; ValueError names the model key the family cannot represent."""
    problem = family_problem(cfg)
    if problem:
        raise ValueError(problem)
    return FAMILIES[cfg.hf_family]


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Canonical name -> the name in ``cfg.hf_family``'s checkpoints, for every tensor of ``cfg``."""
    renames = [(re.compile(pattern), name) for pattern, name in family_of(cfg).renames]
    out = {}
    for canonical in canonical_param_shapes(cfg):
        name = canonical
        for pattern, repl in renames:
            name = pattern.sub(repl, name)
        out[canonical] = name
    return out


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json transformers loads for ``cfg`` (``cfg.hf_family``; inverse of load_hf_config)."""
    return _hf_config_dict(cfg, _DTYPE_NAMES.get(dtype, "float32"))


# --------------------------------------------------------------------------------------------
# weights in
# --------------------------------------------------------------------------------------------


def _weight_map(ckpt_dir: Path) -> tuple[dict[str, str], Path]:
    """tensor name -> shard file name, and the file that says so (index or single file)."""
    index = ckpt_dir / INDEX
    if index.is_file():
        content = read_json(index)
        if not isinstance(content, dict) or not isinstance(content.get("weight_map"), dict):
            raise CheckpointError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        return dict(content["weight_map"]), index
    single = ckpt_dir / SINGLE
    if single.is_file():
        with open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), SINGLE), single
    raise CheckpointError(f"{ckpt_dir} has neither {INDEX} nor {SINGLE}")


def _without_mtp(ckpt_dir: Path, weight_map: dict[str, str], cfg: ModelConfig) -> dict[str, str]:
    """``weight_map`` less the multi-token-prediction layers (``model.layers.{L..L+n-1}.*`` of a
    DeepSeek-V3 / GLM-4.5 checkpoint with ``num_nextn_predict_layers`` = n): the learner trains
    no MTP head, so they are skipped, with one log line."""
    n = mtp_layers(ckpt_dir) if (ckpt_dir / CONFIG).is_file() else 0
    if not n:
        return weight_map
    layer = re.compile(r"model\.layers\.(\d+)\.")
    mtp = range(cfg.num_layers, cfg.num_layers + n)

    def is_mtp(name: str) -> bool:
        m = layer.match(name)
        return m is not None and int(m.group(1)) in mtp

    skipped = [k for k in weight_map if is_mtp(k)]
    if skipped:
        log.warning(
            "%s: skipping %d MTP tensors of layers %s (num_nextn_predict_layers=%d): the learner trains "
            "no MTP head, and an export says num_nextn_predict_layers=0",
            ckpt_dir,
            len(skipped),
            list(mtp),
            n,
        )
    return {k: v for k, v in weight_map.items() if not is_mtp(k)}


def hf_weight_index(ckpt_dir: str | Path, cfg: ModelConfig) -> StoredWeights:
    """Where every canonical tensor of ``cfg`` lies in an HF checkpoint of ``cfg.hf_family``, checked
    from the index and the shard headers alone (no tensor data is read).

    CheckpointError names the tensor and the file for a missing, unexpected or mis-shaped tensor."""
    ckpt_dir = Path(ckpt_dir)
    file_names = hf_names(cfg)
    expected = {file_names[k]: shape for k, shape in canonical_param_shapes(cfg).items()}
    weight_map, listed_in = _weight_map(ckpt_dir)
    weight_map = _without_mtp(ckpt_dir, weight_map, cfg)
    missing = [k for k in expected if k not in weight_map]
    if missing:
        raise CheckpointError(f"{listed_in}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    unexpected = [k for k in weight_map if k not in expected]
    if unexpected:
        raise CheckpointError(
            f"{ckpt_dir / weight_map[unexpected[0]]}: unexpected tensor {unexpected[0]!r} "
            f"({len(unexpected)} unexpected in all)"
        )
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    found: dict[str, StoredTensor] = {}
    for file, names in by_file.items():
        path = ckpt_dir / file
        if not path.is_file():
            raise CheckpointError(
                f"{listed_in} lists shard {file} for tensor {names[0]!r}, but {path} does not exist"
            )
        present, _ = read_header(path)
        for name in names:
            if name not in present:
                raise CheckpointError(f"{path}: missing tensor {name!r} (listed there by {listed_in.name})")
            shape = present[name].shape
            if shape != expected[name]:
                raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, expected {expected[name]}")
            found[name] = present[name]
    return StoredWeights({canonical: found[name] for canonical, name in file_names.items()})


def read_hf_weights(ckpt_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every canonical tensor of ``cfg`` from an HF checkpoint of ``cfg.hf_family``, as stored
    (dtype unchanged): the whole model (``hf_weight_index`` checks it first)."""
    return hf_weight_index(ckpt_dir, cfg).read_all()


def open_hf_checkpoint(ckpt_dir: str | Path, model: ModelConfig) -> StoredWeights:
    """An HF checkpoint made for ``model``, checked from config.json, the index and the shard
    headers (a differing architecture field is refused, naming it); read on demand."""
    fields = load_hf_config(ckpt_dir)
    for key in ("hf_family", *ARCH_FIELDS):
        if key in fields and fields[key] != getattr(model, key):
            raise CheckpointError(
                f"{Path(ckpt_dir) / CONFIG} describes model.{key}={fields[key]}, "
                f"but the config has model.{key}={getattr(model, key)}"
            )
    return hf_weight_index(ckpt_dir, model)


def load_hf_checkpoint(ckpt_dir: str | Path, model: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical fp32 weights of an HF checkpoint made for ``model`` (the whole model: tools and
    tests; a training rank reads its shard from ``open_hf_checkpoint``)."""
    return {k: v.float() for k, v in open_hf_checkpoint(ckpt_dir, model).read_all().items()}


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def checkpoint_dtype(ckpt_dir: str | Path) -> torch.dtype:
    """The dtype an HF checkpoint's tensors are stored in: its embedding's (some tensors, like
    DeepSeek-V3's expert bias, are kept fp32 in a bf16 checkpoint)."""
    weight_map, _ = _weight_map(Path(ckpt_dir))
    embed = "model.embed_tokens.weight"
    name = embed if embed in weight_map else next(iter(weight_map))
    with open_safetensors(Path(ckpt_dir) / weight_map[name]) as f:
        stored = f.get_slice(name).get_dtype()
    return _SAFETENSORS_DTYPES.get(stored, torch.float32)


# --------------------------------------------------------------------------------------------
# weights out
# --------------------------------------------------------------------------------------------


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy in name order: a new shard starts when the next tensor would overflow this one."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _export_dtype(canonical_name: str, dtype: torch.dtype) -> torch.dtype:
    """The expert bias stays fp32 (as on the DeepSeek-V3 hub and in transformers' router)."""
    return torch.float32 if canonical_name.endswith(".e_score_correction_bias") else dtype


def write_hf_checkpoint(
    out_dir: str | Path,
    canonical: dict[str, torch.Tensor],
    cfg: ModelConfig,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write ``canonical`` (every tensor of ``cfg``) as an HF checkpoint of ``cfg.hf_family`` (its
    own tensor names and config.json) that ``AutoModelForCausalLM.from_pretrained`` loads.
    ``out_dir`` must not exist yet. ``extra_files`` (name -> bytes: the tokenizer's files) are
    written next to the weights, so the directory is a complete HF model.

    Files go to ``out_dir.tmp``, are fsynced, then the directory is renamed into place."""
    from moe_rl.weights.canonical import check_canonical_weights

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise CheckpointError(f"{out_dir} already exists; an HF export never overwrites")
    names = hf_names(cfg)  # a stable, model-ordered layout; refuses what the family cannot hold
    check_canonical_weights(canonical, cfg)
    tensors = {
        name: canonical[k].detach().to(_export_dtype(k, dtype or canonical[k].dtype)).contiguous()
        for k, name in names.items()
    }
    shards = plan_shards({k: t.numel() * t.element_size() for k, t in tensors.items()}, max_shard_bytes)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed export
    tmp.mkdir(parents=True)
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, shard in zip(files, shards):
        save_file({k: tensors[k] for k in shard}, str(tmp / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: file for file, shard in zip(files, shards) for k in shard},
        }
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    first_dtype = next(iter(tensors.values())).dtype  # the embedding's: the model's dtype
    (tmp / CONFIG).write_text(json.dumps(hf_config_dict(cfg, first_dtype), indent=2) + "\n")
    for name, blob in (extra_files or {}).items():
        (tmp / name).write_bytes(blob)
    for p in tmp.iterdir():
        fsync_path(p)
    fsync_path(tmp)
    os.replace(tmp, out_dir)
    fsync_path(out_dir.parent)
    return out_dir
