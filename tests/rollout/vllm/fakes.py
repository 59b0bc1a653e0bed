"""Shared fakes of the vLLM package's tests (a helper module, no tests): a built-in rollout encoded
as vLLM 0.33 returns it (``as_vllm``, from vllm 0.33.0's own classes as pinned from its wheel:
tests/rollout/vllm_format.py), and ``vllm.LLM``'s weight-transfer surface (``FakeTransferLLM``)
driving our registered receiver for real."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from unittest import mock

import numpy as np
import pytest
import torch

from moe_rl.rollout.vllm.engine import register_transfer_backend
from moe_rl.rollout.vllm.requests import to_rollout_batch
from moe_rl.rollout.vllm.transfer import TRANSFER_BACKEND
from moe_rl.routing.record import RouteError, RouteHeader
from tests.rollout.vllm_format import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    routed_experts_dtype,
)

PAD_ID = 0


def as_vllm(batch, cfg, b: int) -> RequestOutput:
    """Sample b of a RolloutBatch as vLLM 0.33 returns it for a ``build_requests`` request
    (logprobs=0, detokenize=False): routes over ALL decoder layers (dense rows zero) in vLLM's
    dtype for E experts; one ``{sampled: Logprob}`` dict per generated token (rank is not read);
    finish_reason "stop" with the stop token as stop_reason, or "length"."""
    P, G = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
    toks = batch.tokens_BS[b, : P + G].tolist()
    all_TAK = np.zeros(
        (P + G - 1, cfg.num_layers, cfg.moe_router_topk), dtype=routed_experts_dtype(cfg.num_experts)
    )
    all_TAK[:, cfg.moe_layers, :] = batch.routes[b].numpy()
    lp_G = [float(batch.logprobs_BS[b, P + g]) for g in range(G)]
    lps = [{toks[P + g]: Logprob(logprob=lp_G[g], rank=1, decoded_token=None)} for g in range(G)]
    done = bool(batch.finished_B[b])
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=toks[P:],
        cumulative_logprob=sum(lp_G),
        logprobs=lps,
        routed_experts=all_TAK,
        finish_reason="stop" if done else "length",
        stop_reason=toks[-1] if done else None,
    )
    return RequestOutput(
        request_id=str(b),
        prompt=None,
        prompt_token_ids=toks[:P],
        prompt_logprobs=None,
        outputs=[completion],
        finished=True,
        num_cached_tokens=0,
    )


def decode(outs, cfg, **kw):
    return to_rollout_batch(outs, 3, PAD_ID, RouteHeader.for_model(cfg), num_layers=cfg.num_layers, **kw)


def refused(outs: list, cfg) -> str:
    """The one-line RouteError that decoding ``outs`` raises (it must raise)."""
    with pytest.raises(RouteError) as e:
        decode(outs, cfg)
    return str(e.value)


VLLM = ["rollout.engine=vllm"]


class _FakeTransferEngineBase:
    """The part of vLLM 0.33's ``WeightTransferEngine`` (vllm/distributed/weight_transfer/base.py)
    that our backend inherits through ``IPCWeightTransferEngine``: the worker's ``update_weights(
    update_info: dict)`` builds ``update_info_cls(**update_info)`` (``parse_update_info``) and
    hands it to ``receive_weights``; the engine holds the worker's model as ``self.model``."""

    def __init__(self, model) -> None:
        self.model = model

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.update_info_cls(**update_info))


@functools.cache
def inproc_engine_class() -> type:
    """The class ``engine.register_transfer_backend`` registers (the GPU path's receiver, run for real),
    built against stand-ins of the three vLLM modules it imports: vLLM 0.33 is GPU-only."""

    @dataclasses.dataclass
    class WeightTransferUpdateInfo:
        pass

    registered: dict[str, type] = {}

    class WeightTransferEngineFactory:
        @staticmethod
        def register_engine(name: str, cls: type) -> None:
            if name in registered:
                raise ValueError(f"Weight transfer engine {name!r} is already registered.")
            registered[name] = cls

    pkg = "vllm.distributed.weight_transfer"
    names = ("vllm", "vllm.distributed", pkg, f"{pkg}.base", f"{pkg}.ipc_engine")
    mods = {n: types.ModuleType(n) for n in names}
    mods[pkg].WeightTransferEngineFactory = WeightTransferEngineFactory
    mods[f"{pkg}.base"].WeightTransferUpdateInfo = WeightTransferUpdateInfo
    mods[f"{pkg}.ipc_engine"].IPCWeightTransferEngine = _FakeTransferEngineBase
    with mock.patch.dict(sys.modules, mods):
        register_transfer_backend()
        register_transfer_backend()  # idempotent: a second engine in the process
    return registered[TRANSFER_BACKEND]


class _RecordingModel:
    """vLLM's model as the receiver sees it: ``load_weights`` takes (name, tensor) pairs."""

    def __init__(self, loaded: dict[str, torch.Tensor]) -> None:
        self.loaded = loaded

    def load_weights(self, weights) -> None:
        self.loaded.update(weights)


class FakeTransferLLM:
    """``vllm.LLM``'s weight-transfer surface as 0.33 defines it: ``init_weight_transfer_engine(
    {"init_info": ...})``, ``start_weight_update()``, ``update_weights({"update_info": ...})``,
    ``finish_weight_update(weight_version: str | None = None)``, ``get_weight_version() -> str``
    ("default" until one is set), plus ``reset_prefix_cache`` / ``apply_model``. The worker side
    follows gpu_worker.py: update/finish outside a session raise, a failed update ends it; each
    update goes to our registered backend's own ``receive_weights`` (``inproc_engine_class``),
    which loads into ``model`` (default: a record of what it got, by reference)."""

    def __init__(self, fail_on_update: int = -1, ignore_version: bool = False, model=None) -> None:
        self.calls: list[str] = []
        self.updates: list[dict] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.worker = inproc_engine_class()(model if model is not None else _RecordingModel(self.loaded))
        self.active = False
        self.version = "default"
        self.fail_on_update, self.ignore_version = fail_on_update, ignore_version

    def init_weight_transfer_engine(self, request: dict) -> None:
        self.calls.append("init")
        assert set(request) == {"init_info"}

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self.calls.append("start")
        self.active = True

    def update_weights(self, request: dict) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        self.calls.append("update")
        info = request["update_info"]
        if len(self.updates) == self.fail_on_update:
            self.active = False
            raise RuntimeError("worker failed")
        self.updates.append(info)
        self.worker.update_weights(info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.calls.append("finish")
        self.active = False
        if weight_version is not None and not self.ignore_version:
            self.version = weight_version

    def get_weight_version(self) -> str:
        return self.version

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def apply_model(self, func):
        self.calls.append("apply_model")
        outer = self

        class Model:
            def load_weights(self, weights):
                outer.loaded.update(weights)

        return [func(Model())]
