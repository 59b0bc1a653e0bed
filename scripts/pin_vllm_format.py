"""Print the vLLM output format moe-rl decodes, read from a vllm wheel's Python source.

    python scripts/pin_vllm_format.py vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl > new.json
    diff tests/rollout/vllm_format.json new.json

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
        "routed_experts": _routed_experts(trees),
        "sampling_params": {"source": _src(SAMPLING, sampling), "fields": fields},
    }


def _wheel_version(zf: zipfile.ZipFile) -> str:
    meta = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
    if len(meta) != 1:
        raise FormatError(f"{zf.filename}: expected one *.dist-info/METADATA, found {meta}")
    for line in zf.read(meta[0]).decode().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    raise FormatError(f"{zf.filename}: {meta[0]} has no Version")


def spec_from(path: str | Path) -> dict[str, Any]:
    """The spec of a wheel file, or of a directory holding ``vllm/`` (version then None)."""
    path = Path(path)
    if path.is_dir():
        return {"vllm": None, **extract(lambda p: (path / p).read_text())}
    with zipfile.ZipFile(path) as zf:
        return {"vllm": _wheel_version(zf), **extract(lambda p: zf.read(p).decode())}


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
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(dumps(spec_from(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
