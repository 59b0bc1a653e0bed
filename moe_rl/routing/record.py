"""The route record: which experts routed every token of a sample, in every MoE layer.

Per sample ``ids_TLK`` [T - 1 - start, L, K]: row r is the Top-K routing computed when token
``start + r`` was the input (prompt rows from prefill, response rows from decode; the last
sampled token never went through the model and has no row). L counts MoE layers only, in the
order of ``RouteHeader.layer_ids`` (global 0-based decoder-layer numbers). Ids are logical
expert ids. The dtype is the narrowest unsigned type that holds E ids plus a MISSING sentinel
(its max value): uint8 for E <= 255, else uint16. Records stay jagged; they are widened to
int64 per layer only when a micro-batch is laid out for replay (``routing/row_layout.py``).

Ingest (``validate``) is strict and names sample, layer and row: wrong shape or dtype, a row
count that does not match the sample's tokens, ids out of range, repeated ids in a row, an
all-zero MoE layer (the classic symptom of an engine that never captured a layer), a
fingerprint from another model. ``from_vllm`` adapts vLLM's ``CompletionOutput.routed_experts``.

Shape suffixes: N rows (tokens), L MoE layers, K top-k, A all decoder layers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from moe_rl.config import ARCH_FIELDS, ModelConfig
from moe_rl.errors import RouteError
from moe_rl.routing.provenance import Provenance, check_provenance


def route_dtype(num_experts: int) -> torch.dtype:
    """Narrowest unsigned dtype holding ids 0..E-1 plus the MISSING sentinel (the dtype max)."""
    if num_experts <= 255:
        return torch.uint8
    if num_experts <= 65535:
        return torch.uint16
    raise ValueError(f"{num_experts} experts do not fit a uint16 route record")


def missing_id(dtype: torch.dtype) -> int:
    return int(torch.iinfo(dtype).max)


def model_fingerprint(cfg: ModelConfig) -> str:
    """Identity of the routing function's shape: records from another model are refused."""
    arch = {k: getattr(cfg, k) for k in ARCH_FIELDS}
    return hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RouteHeader:
    layer_ids: tuple[int, ...]  # global 0-based layer number of each MoE layer, in record order
    num_experts: int
    top_k: int
    fingerprint: str

    @classmethod
    def for_model(cls, cfg: ModelConfig) -> RouteHeader:
        return cls(tuple(cfg.moe_layers), cfg.num_experts, cfg.moe_router_topk, model_fingerprint(cfg))

    @property
    def dtype(self) -> torch.dtype:
        return route_dtype(self.num_experts)


@dataclass
class RouteRecord:
    ids_TLK: torch.Tensor
    prompt_len: int
    start: int  # token position of row 0 (multi-turn: rows before it were sent earlier)
    header: RouteHeader
    prov: Provenance | None = None  # per row: version, source, turn (moe_rl/routing/provenance.py)

    @property
    def num_rows(self) -> int:
        return int(self.ids_TLK.shape[0])


@dataclass
class RouteBatch:
    """Route records of many samples, jagged: rows of all samples concatenated, no padding.

    ids_NLK: [sum(rows_B), L, K] route dtype; rows_B / start_B / prompt_len_B: int64 [B]; prov:
    the rows' provenance, concatenated as the ids (None: the engine records none)."""

    ids_NLK: torch.Tensor
    rows_B: torch.Tensor
    start_B: torch.Tensor
    prompt_len_B: torch.Tensor
    header: RouteHeader
    prov: Provenance | None = None

    @property
    def num_samples(self) -> int:
        return int(self.rows_B.shape[0])

    @property
    def first_B(self) -> torch.Tensor:
        return torch.cumsum(self.rows_B, 0) - self.rows_B

    @property
    def sample_N(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.num_samples, device=self.rows_B.device), self.rows_B)

    @property
    def position_N(self) -> torch.Tensor:
        """Token position of every row."""
        sample_N = self.sample_N
        return (
            torch.arange(self.ids_NLK.shape[0], device=self.rows_B.device)
            - self.first_B[sample_N]
            + self.start_B[sample_N]
        )

    @classmethod
    def from_records(cls, records: list[RouteRecord]) -> RouteBatch:
        if not records:
            raise ValueError("no route records")
        header = records[0].header
        L, K = len(header.layer_ids), header.top_k
        for b, r in enumerate(records):
            if r.header != header:
                raise RouteError(f"sample {b}: route header {r.header} differs from sample 0's {header}")
            ids = r.ids_TLK
            if not isinstance(ids, torch.Tensor):
                raise RouteError(f"sample {b}: route ids are a {type(ids).__name__}, expected a torch.Tensor")
            if ids.dtype != header.dtype:
                raise RouteError(
                    f"sample {b}: route dtype {ids.dtype}, expected {header.dtype} for "
                    f"{header.num_experts} experts (nothing is cast)"
                )
            if ids.dim() != 3 or tuple(ids.shape[1:]) != (L, K):
                raise RouteError(
                    f"sample {b}: route shape {tuple(ids.shape)}, expected [rows, {L} MoE layers, "
                    f"{K}] (MoE layers {list(header.layer_ids)})"
                )
            if (r.prov is None) != (records[0].prov is None):
                raise RouteError(f"sample {b}: route provenance on some samples of the batch only")
            if r.prov is not None and r.prov.num_rows != r.num_rows:
                raise RouteError(
                    f"sample {b}: route provenance of {r.prov.num_rows} rows for {r.num_rows} rows"
                )
        prov = None if records[0].prov is None else Provenance.cat([r.prov for r in records])
        return cls(
            torch.cat([r.ids_TLK for r in records]),
            torch.tensor([r.num_rows for r in records], dtype=torch.int64),
            torch.tensor([r.start for r in records], dtype=torch.int64),
            torch.tensor([r.prompt_len for r in records], dtype=torch.int64),
            header,
            prov,
        )

    def select(self, idx_B: torch.Tensor) -> RouteBatch:
        """The samples ``idx_B`` (in that order), one vectorized gather."""
        rows_B = self.rows_B[idx_B]
        row_N = torch.repeat_interleave(self.first_B[idx_B], rows_B) + (
            torch.arange(int(rows_B.sum()), device=rows_B.device)
            - torch.repeat_interleave(torch.cumsum(rows_B, 0) - rows_B, rows_B)
        )
        prov = None if self.prov is None else self.prov.index(row_N.to(self.prov.version_N.device))
        return RouteBatch(
            self.ids_NLK[row_N], rows_B, self.start_B[idx_B], self.prompt_len_B[idx_B], self.header, prov
        )

    def records(self) -> list[RouteRecord]:
        rows = self.rows_B.tolist()
        chunks = torch.split(self.ids_NLK, rows)
        provs = [None] * len(rows) if self.prov is None else self.prov.split(rows)
        return [
            RouteRecord(ids, int(p), int(s), self.header, pv)
            for ids, p, s, pv in zip(chunks, self.prompt_len_B.tolist(), self.start_B.tolist(), provs)
        ]


def save_records(records: list[RouteRecord]) -> bytes:
    """Serialise a batch of records (one header) with safetensors; jagged rows are concatenated."""
    if not records:
        raise ValueError("no route records to save")
    header = records[0].header
    if any(r.header != header for r in records):
        raise ValueError("records of one batch must share a header")
    rows = torch.tensor([r.num_rows for r in records], dtype=torch.int64)
    meta = torch.tensor([[r.prompt_len, r.start] for r in records], dtype=torch.int64)
    tensors = {"ids": torch.cat([r.ids_TLK for r in records]).contiguous(), "rows": rows, "meta": meta}
    if any(r.prov is not None for r in records):
        if any(r.prov is None for r in records):
            raise ValueError("records of one batch carry provenance all or none")
        tensors.update(Provenance.cat([r.prov for r in records]).tensors())
    return st_save(tensors, metadata={"header": json.dumps(dataclasses.asdict(header))})


def load_records(blob: bytes, name: str = "route records") -> list[RouteRecord]:
    """Records saved by ``save_records``. A blob that is not one (truncated, another format,
    inconsistent row counts) is a RouteError naming ``name`` (e.g. the file) and the problem; the
    records are then checked by ``RouteBatch.from_records`` (dtype, shape per sample)."""
    try:
        tensors = st_load(blob)
        # safetensors layout: u64 little-endian header size, then the JSON header with __metadata__
        n_header = int.from_bytes(blob[:8], "little")
        h = json.loads(json.loads(blob[8 : 8 + n_header])["__metadata__"]["header"])
        header = RouteHeader(tuple(h["layer_ids"]), h["num_experts"], h["top_k"], h["fingerprint"])
        ids, rows, meta = tensors["ids"], tensors["rows"], tensors["meta"]
        prov = None
        if "prov_version" in tensors:
            prov = Provenance(tensors["prov_version"], tensors["prov_source"], tensors["prov_turn"])
    except (SafetensorError, ValueError, KeyError, TypeError, IndexError) as e:  # a foreign or cut blob
        raise RouteError(
            f"{name}: not a complete route-record blob ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if (
        rows.dim() != 1
        or meta.shape != (rows.shape[0], 2)
        or int(rows.sum()) != ids.shape[0]
        or bool((rows < 0).any())
    ):
        raise RouteError(
            f"{name}: row counts {rows.tolist()} (sum {int(rows.sum())}) do not match "
            f"{ids.shape[0]} id rows and meta {tuple(meta.shape)}"
        )
    if prov is not None and any(t.dim() != 1 or t.shape[0] != ids.shape[0] for t in prov.tensors().values()):
        raise RouteError(
            f"{name}: provenance of {[tuple(t.shape) for t in prov.tensors().values()]} entries "
            f"for {ids.shape[0]} id rows"
        )
    chunks = torch.split(ids, rows.tolist())
    provs = [None] * len(chunks) if prov is None else prov.split(rows.tolist())
    records = [RouteRecord(c, int(m[0]), int(m[1]), header, pv) for c, m, pv in zip(chunks, meta, provs)]
    RouteBatch.from_records(records)  # dtype and shape, per sample
    return records


def vllm_route_dtype(num_experts: int) -> np.dtype:
    """The dtype of vLLM 0.33's ``routed_experts``: uint8 up to 256 experts, else uint16
    (``RoutedExpertsCapturer``; pinned in tests/rollout/vllm_format.json)."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def from_vllm(
    routed_experts: np.ndarray,
    *,
    num_tokens: int,
    prompt_len: int,
    header: RouteHeader,
    prompt_start: int = 0,
    sample: int = 0,
    num_layers: int | None = None,
) -> RouteRecord:
    """Adapt vLLM's ``CompletionOutput.routed_experts`` ([T - 1 - prompt_start, A, K] numpy array in
    ``vllm_route_dtype``, every decoder layer, dense-layer rows zero, checked) to a record: keep the MoE
    layers by global number and move to our dtype (uint8 can hold 256 ids but then no MISSING).
    A must equal ``num_layers`` (the model's decoder layers; default: the last MoE layer + 1, which
    it is for ``RouteHeader.for_model``), exactly: more layers are refused, not cut.

    Raises RouteError naming the sample on anything that is not this sample's routes in vLLM's
    format: another type or dtype (nothing is cast before the check), another shape, or an id
    outside [0, num_experts) in a MoE layer (named with layer and row)."""
    where = f"sample {sample}: vLLM routed_experts"
    if not isinstance(routed_experts, np.ndarray):
        raise RouteError(f"{where} is a {type(routed_experts).__name__}, expected a numpy.ndarray")
    arr, want = routed_experts, vllm_route_dtype(header.num_experts)
    if arr.dtype != want:
        raise RouteError(
            f"{where} dtype is {arr.dtype}, expected {want} for {header.num_experts} experts "
            f"(vLLM 0.33: uint8 up to 256 experts, else uint16)"
        )
    if arr.ndim != 3:
        raise RouteError(f"{where} has shape {arr.shape}, expected [T-1, layers, K]")
    expect_rows = num_tokens - 1 - prompt_start
    if arr.shape[0] != expect_rows:
        raise RouteError(
            f"sample {sample}: vLLM returned {arr.shape[0]} route rows for {num_tokens} tokens "
            f"from position {prompt_start}; expected {expect_rows}"
        )
    num_layers = max(header.layer_ids) + 1 if num_layers is None else num_layers
    if arr.shape[1] != num_layers:
        raise RouteError(f"{where} has {arr.shape[1]} layers, the model has {num_layers} decoder layers")
    if max(header.layer_ids) >= arr.shape[1]:
        raise RouteError(
            f"{where} has {arr.shape[1]} layers but MoE layer {max(header.layer_ids)} is expected"
        )
    if arr.shape[2] != header.top_k:
        raise RouteError(f"{where} has K={arr.shape[2]}, model top-k is {header.top_k}")
    dense = [i for i in range(arr.shape[1]) if i not in set(header.layer_ids)]
    written_NL = arr[:, dense, :].any(-1)  # vLLM never writes a dense layer's rows: they stay 0
    if written_NL.any():
        n, li = (int(x) for x in np.argwhere(written_NL)[0])
        raise RouteError(
            f"sample {sample}, layer {dense[li]}, row {prompt_start + n}: vLLM wrote expert ids "
            f"{arr[n, dense[li]].tolist()} for a dense layer (rows by layer number do not match the model)"
        )
    moe_NLK = arr[:, list(header.layer_ids), :]
    never_L = (moe_NLK == 0).all(axis=(0, 2)) if arr.shape[0] else np.zeros(len(header.layer_ids), bool)
    if never_L.any():  # vllm#33013: a layer whose capture was never bound reads as expert 0, K times
        raise RouteError(
            f"sample {sample}, layer {header.layer_ids[int(np.argmax(never_L))]}: every vLLM row of this "
            f"MoE layer is expert 0, {header.top_k} times (routes never captured for this layer?)"
        )
    bad_NLK = moe_NLK >= header.num_experts
    if bad_NLK.any():
        n, li, k = (int(x) for x in np.argwhere(bad_NLK)[0])
        raise RouteError(
            f"sample {sample}, layer {header.layer_ids[li]}, row {prompt_start + n}: vLLM expert id "
            f"{int(moe_NLK[n, li, k])} outside [0, {header.num_experts})"
        )
    ids_NLK = torch.from_numpy(moe_NLK.astype(np.int64)).to(header.dtype)  # ids < E fit the record dtype
    return RouteRecord(ids_NLK, prompt_len, prompt_start, header)


def validate(batch: RouteBatch, num_tokens_B: torch.Tensor, header: RouteHeader) -> None:
    """Strict ingest check; RouteError names the first bad sample, layer and row.

    ``num_tokens_B[b]`` is sample b's prompt + response length. Provenance, when the batch has it,
    is checked too (``check_provenance``: one entry per row, sources, versions, NONE exactly on
    MISSING rows)."""
    B = batch.num_samples
    if int(num_tokens_B.shape[0]) != B:
        raise RouteError(f"{B} route records for {int(num_tokens_B.shape[0])} samples")
    if batch.header.fingerprint != header.fingerprint:
        raise RouteError(
            f"route fingerprint {batch.header.fingerprint} is not the learner model's {header.fingerprint}"
        )
    if batch.header != header:
        raise RouteError(f"route header {batch.header} differs from the learner's {header}")
    L, K = len(header.layer_ids), header.top_k
    if batch.ids_NLK.dtype != header.dtype:  # one tensor for the batch: every sample has it
        raise RouteError(
            f"sample 0 (and every other): route dtype {batch.ids_NLK.dtype}, expected {header.dtype}"
        )
    if batch.ids_NLK.dim() != 3 or tuple(batch.ids_NLK.shape[1:]) != (L, K):
        raise RouteError(
            f"sample 0 (and every other): route shape {tuple(batch.ids_NLK.shape)}, expected [rows, {L}, {K}]"
        )
    expect_B = num_tokens_B - 1 - batch.start_B
    wrong_B = batch.rows_B != expect_B
    if bool(wrong_B.any()):
        b = int(wrong_B.nonzero()[0])
        raise RouteError(
            f"sample {b}: {int(batch.rows_B[b])} route rows for {int(num_tokens_B[b])} tokens "
            f"from position {int(batch.start_B[b])}; expected {int(expect_B[b])}"
        )
    ids_NLK = batch.ids_NLK.to(torch.int64)
    if ids_NLK.numel() == 0:
        return
    sample_N, row_N = batch.sample_N, batch.position_N
    missing = missing_id(header.dtype)
    present_NLK = ids_NLK != missing
    if batch.prov is not None:
        check_provenance(batch.prov, present_NLK.any(-1).any(-1), sample_N, row_N)
    bad = present_NLK & (ids_NLK >= header.num_experts)
    _raise_first(
        bad.any(-1),
        sample_N,
        row_N,
        header,
        lambda n, li: f"expert id {int(ids_NLK[n, li].max())} outside [0, {header.num_experts})",
    )
    srt_NLK = ids_NLK.sort(-1).values
    dup_NL = ((srt_NLK[..., 1:] == srt_NLK[..., :-1]) & (srt_NLK[..., 1:] != missing)).any(-1)
    _raise_first(
        dup_NL, sample_N, row_N, header, lambda n, li: f"repeated expert ids {ids_NLK[n, li].tolist()}"
    )
    partial_NL = present_NLK.any(-1) & ~present_NLK.all(-1)
    _raise_first(
        partial_NL,
        sample_N,
        row_N,
        header,
        lambda n, li: f"row mixes MISSING and ids {ids_NLK[n, li].tolist()}",
    )
    # an engine that never captured a layer leaves it all zero: per sample and layer
    zero_NL = (ids_NLK == 0).all(-1).to(torch.int64)
    zero_BL = zero_NL.new_zeros((B, L)).index_add_(0, sample_N, zero_NL)
    all_zero_BL = (zero_BL == batch.rows_B[:, None]) & (batch.rows_B[:, None] > 0)
    if bool(all_zero_BL.any()):
        b, li = (int(x) for x in all_zero_BL.nonzero()[0])
        raise RouteError(
            f"sample {b}, layer {header.layer_ids[li]}: every row routes to expert 0 only "
            f"(an engine that did not capture this layer?)"
        )


def _raise_first(
    bad_NL: torch.Tensor, sample_N: torch.Tensor, row_N: torch.Tensor, header: RouteHeader, what
) -> None:
    if not bool(bad_NL.any()):
        return
    n, li = (int(x) for x in bad_NL.nonzero()[0])
    raise RouteError(
        f"sample {int(sample_N[n])}, layer {header.layer_ids[li]}, row {int(row_N[n])}: {what(n, li)}"
    )
