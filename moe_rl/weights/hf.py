"""Hugging Face checkpoints in and out: ``config.json`` + (sharded) safetensors of the Qwen3-MoE
and Mixtral families.

Canonical weight names ARE the HF Qwen3-MoE hub names (``weights/megatron_shards.py`` maps them
to megatron and back for every EP/TP/PP layout). Other families are renamed here, at the file
boundary only, by one small table per family (``FAMILIES``, keyed by ``model_type`` ==
``ModelConfig.hf_family``): Mixtral's ``block_sparse_moe.gate`` is ``mlp.gate`` and its experts'
``w1``/``w3``/``w2`` are ``gate_proj``/``up_proj``/``down_proj``. This module owns the file formats
and the strict checks (docs/design.md 9; issue 7).

- ``load_hf_config``: config.json -> ModelConfig fields; anything the learner cannot represent
  exactly (unrenormalised Top-K, sliding window, tied embeddings, dense layers that are not the
  first k, shared experts, RoPE scaling, router jitter, ...) is refused, naming the key and the file.
- ``read_hf_weights``: one tensor at a time per shard (``safe_open``); every expected tensor must be
  present with its shape and nothing else may be there; errors name the tensor and the file.
- ``write_hf_checkpoint``: shards + ``model.safetensors.index.json`` + ``config.json`` written into
  a temporary sibling directory, fsynced and renamed, so a crash never leaves a half checkpoint.

File formats only: no learner, no launcher, so the vLLM engine imports it freely. Exporting a run
(``moe-rl export-hf``: a run's dist checkpoint loaded by the learner -> HF) is ``weights/export.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moe_rl.config import ARCH_FIELDS, ModelConfig
from moe_rl.errors import CheckpointError
from moe_rl.fsutil import fsync_path, open_safetensors, read_json
from moe_rl.weights.canonical import canonical_param_shapes

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------


def _refuse(path: Path, key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: key {key!r} = {value!r}: {why}")


def _require(hf: dict, path: Path, key: str, ok, why: str, default: Any = None) -> None:
    value = hf.get(key, default)
    if not ok(value):
        raise _refuse(path, key, value, why)


def _first_k_dense(hf: dict, path: Path, num_layers: int, num_experts: int) -> int:
    """Qwen3-MoE makes layer i MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step
    == 0; the learner represents exactly the pattern "first k layers dense, the rest MoE"."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(hf.get("mlp_only_layers") or [])
    dense = [i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0 or num_experts == 0]
    k = len(dense)
    if dense != list(range(k)) or k >= num_layers:
        key = "decoder_sparse_step" if step != 1 else "mlp_only_layers"
        raise _refuse(
            path,
            key,
            hf.get(key),
            f"dense layers {dense} are not the first k of {num_layers} "
            "with at least one MoE layer after them (the learner's first_k_dense pattern)",
        )
    return k


def _rope_theta(hf: dict, path: Path, default: float) -> float:
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type") not in (None, "default"):
        raise _refuse(
            path, "rope_parameters.rope_type", rope.get("rope_type"), "only plain RoPE is supported"
        )
    _require(
        hf,
        path,
        "rope_scaling",
        lambda v: not v or v.get("rope_type", v.get("type")) == "default",
        "RoPE scaling is not supported",
    )
    theta = float(rope.get("rope_theta", hf.get("rope_theta", default)))
    if theta != int(theta):  # megatron's rotary_base is an int
        raise _refuse(path, "rope_theta", theta, "the learner needs an integer RoPE base")
    return theta


def _qwen3_moe_fields(hf: dict, path: Path) -> dict[str, Any]:
    _require(
        hf,
        path,
        "norm_topk_prob",
        lambda v: v is True,
        "the learner renormalises the Top-K gate weights (softmax over the top-k logits)",
        False,
    )
    _require(
        hf, path, "use_sliding_window", lambda v: not v, "sliding-window attention is not supported", False
    )
    _require(
        hf,
        path,
        "shared_expert_intermediate_size",
        lambda v: not v,
        "Qwen3-MoE has no shared experts; this checkpoint does",
        0,
    )
    num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)))
    return {
        "ffn_hidden_size": int(hf["intermediate_size"]),
        "moe_ffn_hidden_size": int(hf["moe_intermediate_size"]),
        "num_experts": num_experts,
        "qk_layernorm": True,
        "first_k_dense": _first_k_dense(hf, path, int(hf["num_hidden_layers"]), num_experts),
    }


def _mixtral_fields(hf: dict, path: Path) -> dict[str, Any]:
    """Every Mixtral layer is MoE (``intermediate_size`` is the expert's), so the dense FFN size
    is not described; routing is softmax over all experts, Top-K, renormalised: the same gates as
    the learner's softmax over the top-k logits."""
    _require(hf, path, "sliding_window", lambda v: v is None, "sliding-window attention is not supported")
    _require(hf, path, "router_jitter_noise", lambda v: not v, "router jitter noise is not implemented", 0.0)
    return {
        "moe_ffn_hidden_size": int(hf["intermediate_size"]),
        "num_experts": int(hf["num_local_experts"]),
        "qk_layernorm": False,
        "first_k_dense": 0,
    }


def _qwen3_moe_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "intermediate_size": cfg.ffn_hidden_size,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        "num_experts": cfg.num_experts,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.first_k_dense)),
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _mixtral_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "intermediate_size": cfg.moe_ffn_hidden_size,
        "num_local_experts": cfg.num_experts,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


@dataclass(frozen=True)
class Family:
    """One HF model family: its config.json keys and its tensor names.

    ``renames``: (canonical-name regex, family name) pairs for ``re.sub``; canonical names are
    the Qwen3-MoE names, so that family has none. ``qk_layernorm``: the family always (True) or
    never (False) has q_norm/k_norm. ``dense_layers``: it can have dense first layers."""

    architecture: str
    qk_layernorm: bool
    dense_layers: bool
    default_rope_theta: float
    fields: Callable[[dict, Path], dict[str, Any]]  # family-specific config.json -> ModelConfig fields
    config: Callable[[ModelConfig], dict[str, Any]]  # family-specific ModelConfig -> config.json keys
    renames: tuple[tuple[str, str], ...] = ()


# Keyed by config.json's model_type == ModelConfig.hf_family.
FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM",
        qk_layernorm=True,
        dense_layers=True,
        default_rope_theta=10000.0,
        fields=_qwen3_moe_fields,
        config=_qwen3_moe_config,
    ),
    "mixtral": Family(
        "MixtralForCausalLM",
        qk_layernorm=False,
        dense_layers=False,
        default_rope_theta=1e6,
        fields=_mixtral_fields,
        config=_mixtral_config,
        renames=(
            (r"\.mlp\.gate\.weight$", ".block_sparse_moe.gate.weight"),
            (r"\.mlp\.experts\.(\d+)\.gate_proj\.weight$", r".block_sparse_moe.experts.\1.w1.weight"),
            (r"\.mlp\.experts\.(\d+)\.down_proj\.weight$", r".block_sparse_moe.experts.\1.w2.weight"),
            (r"\.mlp\.experts\.(\d+)\.up_proj\.weight$", r".block_sparse_moe.experts.\1.w3.weight"),
        ),
    ),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def model_fields_from_hf(hf: dict, path: Path) -> dict[str, Any]:
    """ModelConfig fields of a parsed config.json (``path`` only names the file in errors).

    ``router_aux_loss_coef`` is not read: it weighs transformers' own training loss (normalised
    ``num_experts_per_tok`` times megatron's, and used only with ``output_router_logits``); the
    run's ``model.router_aux_loss_coeff`` is an RL training choice."""
    _require(hf, path, "model_type", lambda v: v in FAMILIES, f"supported: {SUPPORTED_MODEL_TYPES}")
    family = FAMILIES[hf["model_type"]]
    _require(
        hf,
        path,
        "tie_word_embeddings",
        lambda v: not v,
        "tied input/output embeddings are not supported",
        False,
    )
    _require(hf, path, "hidden_act", lambda v: v == "silu", "experts must be SwiGLU (silu)", "silu")
    _require(hf, path, "attention_bias", lambda v: not v, "attention biases are not supported", False)
    heads = int(hf["num_attention_heads"])
    return {
        "hf_family": hf["model_type"],
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": int(hf["hidden_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_query_groups": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        "moe_router_topk": int(hf["num_experts_per_tok"]),
        "rope_theta": _rope_theta(hf, path, family.default_rope_theta),
        "norm_eps": float(hf["rms_norm_eps"]),
        **family.fields(hf, path),
    }


def load_hf_config(ckpt_dir: str | Path) -> dict[str, Any]:
    """ModelConfig fields from ``ckpt_dir/config.json``; CheckpointError names a refused key."""
    path = Path(ckpt_dir) / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist (an HF checkpoint directory has a config.json)")
    hf = read_json(path)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got a {type(hf).__name__}")
    try:
        return model_fields_from_hf(hf, path)
    except KeyError as e:
        raise CheckpointError(f"{path}: required key {e.args[0]!r} is missing") from None


def family_of(cfg: ModelConfig) -> Family:
    """``cfg``'s HF family; ValueError names the model key the family cannot represent."""
    family = FAMILIES[cfg.hf_family]
    if cfg.qk_layernorm != family.qk_layernorm:
        raise ValueError(
            f"model.qk_layernorm={cfg.qk_layernorm}, but model.hf_family={cfg.hf_family!r} "
            f"{'always' if family.qk_layernorm else 'never'} has q/k norms"
        )
    if cfg.first_k_dense and not family.dense_layers:
        raise ValueError(
            f"model.first_k_dense={cfg.first_k_dense}, but model.hf_family={cfg.hf_family!r} "
            "has no dense layers"
        )
    return family


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
    family = family_of(cfg)
    return {
        "architectures": [family.architecture],
        "model_type": cfg.hf_family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "num_experts_per_tok": cfg.moe_router_topk,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": cfg.router_aux_loss_coeff,
        "dtype": _DTYPE_NAMES.get(dtype, "float32"),
        **family.config(cfg),
    }


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


def read_hf_weights(ckpt_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every canonical tensor of ``cfg`` from an HF checkpoint of ``cfg.hf_family``, as stored
    (dtype unchanged).

    Reads one shard at a time and checks each tensor's shape before loading it. CheckpointError
    names the tensor and the file for a missing, unexpected or mis-shaped tensor."""
    ckpt_dir = Path(ckpt_dir)
    file_names = hf_names(cfg)
    expected = {file_names[k]: shape for k, shape in canonical_param_shapes(cfg).items()}
    weight_map, listed_in = _weight_map(ckpt_dir)
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
    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        path = ckpt_dir / file
        if not path.is_file():
            raise CheckpointError(
                f"{listed_in} lists shard {file} for tensor {names[0]!r}, but {path} does not exist"
            )
        with open_safetensors(path) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(
                        f"{path}: missing tensor {name!r} (listed there by {listed_in.name})"
                    )
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} has shape {shape}, expected {expected[name]}"
                    )
                out[name] = f.get_tensor(name)
    return {canonical: out[name] for canonical, name in file_names.items()}


def load_hf_checkpoint(ckpt_dir: str | Path, model: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical fp32 weights of an HF checkpoint made for ``model``; a differing architecture
    field is refused, naming it."""
    fields = load_hf_config(ckpt_dir)
    for key in ("hf_family", *ARCH_FIELDS):
        if key in fields and fields[key] != getattr(model, key):
            raise CheckpointError(
                f"{Path(ckpt_dir) / CONFIG} describes model.{key}={fields[key]}, "
                f"but the config has model.{key}={getattr(model, key)}"
            )
    return {k: v.float() for k, v in read_hf_weights(ckpt_dir, model).items()}


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def checkpoint_dtype(ckpt_dir: str | Path) -> torch.dtype:
    """The dtype an HF checkpoint's tensors are stored in (its first tensor's)."""
    weight_map, _ = _weight_map(Path(ckpt_dir))
    name = next(iter(weight_map))
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
        name: canonical[k].detach().to(dtype or canonical[k].dtype).contiguous() for k, name in names.items()
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
    first_dtype = next(iter(tensors.values())).dtype
    (tmp / CONFIG).write_text(json.dumps(hf_config_dict(cfg, first_dtype), indent=2) + "\n")
    for name, blob in (extra_files or {}).items():
        (tmp / name).write_bytes(blob)
    for p in tmp.iterdir():
        fsync_path(p)
    fsync_path(tmp)
    os.replace(tmp, out_dir)
    fsync_path(out_dir.parent)
    return out_dir
