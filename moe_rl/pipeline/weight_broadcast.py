"""The weight broadcast learner -> rollout ranks (``parallel.rollout_ranks``): the learner's
canonical stream, a piece (a decoder layer; over ``parallel.sync_bucket_mib`` its tensors or a
group of its experts) at a time, over the sync group (learner rank 0 is its root, group rank 0;
moe_rl/pipeline/placement.py). docs/design.md 15.2.

Wire format of one sync, every message a broadcast from the root or, where engine ranks hold
slices (vLLM TP > 1, ``Sliced``), sent point to point: each rollout rank its own frames, headers
and buckets, of its engine shard's slices alone (moe_rl/weights/engine_shard.py). Host tensors
over gloo, device tensors over NCCL (untested on GPU).

- per chunk: a **frame** int64[5] = (MAGIC, version, CHUNK, chunk index, header bytes); the
  **header**, a uint8 tensor of that many bytes holding JSON: ``{"tensors": [[name, dtype,
  shape, offset], ...], "buckets": [[dtype, start, numel], ...]}``; then each **bucket** in header
  order. The chunk's tensors of one dtype are laid end to end (``offset`` in elements, in header
  order) and that run is cut into buckets of at most ``bucket_bytes`` (at least one element), so
  a bucket may hold many small tensors or part of a large one; each travels as its bytes (uint8).
  A tensor travels in the dtype the rollout engine holds it in (``engine_dtype``; the root casts
  each bucket as it packs it), so the bytes are the engine's, not the learner's fp32.
- after the last chunk: the **end marker**, a frame (MAGIC, version, END, chunk count, 0).
- when the root's stream raises between chunks: a frame (MAGIC, version, ABORT, chunk index, 0)
  before the root re-raises, so receivers fail with one line instead of waiting for the timeout.

JSON, not pickle: a receiver never unpickles bytes it was sent. The version rides in every frame
(``receive_weights`` returns it; a frame of another sync is an error). A stream that stops without
its end marker (the root died or stopped) raises ``WeightSyncError`` on the receiver at the group's
timeout, naming the version and the chunks received; a receiver that left a stream before its end
marker is refused its next one on that group.

Memory: the root packs (and casts) one bucket at a time (one whole contiguous tensor already in
its wire dtype goes without a copy), a receiver holds the chunk it receives (one flat tensor per
dtype, yielded as views): neither holds more than a chunk beyond its weights.

``PendingWeights`` is the engine side, the double buffer: a whole sync staged on the host, applied
at a safe point in one checked ``engine.load_weights``, never half-way.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from moe_rl.config import ModelConfig
from moe_rl.errors import one_line
from moe_rl.pipeline.placement import Group
from moe_rl.rollout.base import RolloutEngine, engine_dtype
from moe_rl.weights.engine_shard import EngineShard, engine_slice

MAGIC = 0x4D4F4557  # "MOEW": a frame, not bytes of something else
CHUNK, END, ABORT = 1, 2, 3
FRAME_LEN = 5
# what broadcast_weights returns, the keys of a split run's sync metrics (docs/design.md 15.2)
SYNC_METRICS = (
    "weight_sync/version",
    "weight_sync/bytes",
    "weight_sync/chunks",
    "weight_sync/buckets",
    "time/weight_broadcast_s",
    "time/weight_broadcast_wait_s",
)
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
}
# a stream a receiver stopped reading before its end marker, per group: its next one is refused
_OPEN: weakref.WeakKeyDictionary[Group, WeightStream] = weakref.WeakKeyDictionary()


class WeightSyncError(RuntimeError):
    """A weight broadcast that broke off, came out of step, or carried another version."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a chunk: where its elements lie in the chunk's run of its dtype."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # elements


@dataclass(frozen=True)
class Bucket:
    """One broadcast: elements [start, start + numel) of the chunk's run of ``dtype``."""

    dtype: str
    start: int
    numel: int


@dataclass(frozen=True)
class Header:
    entries: tuple[Entry, ...]
    buckets: tuple[Bucket, ...]

    def encode(self) -> bytes:
        return json.dumps(
            {
                "tensors": [[e.name, e.dtype, list(e.shape), e.offset] for e in self.entries],
                "buckets": [[b.dtype, b.start, b.numel] for b in self.buckets],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Header:
        raw = json.loads(data)
        return cls(
            tuple(Entry(n, _dtype_name(d), tuple(s), int(o)) for n, d, s, o in raw["tensors"]),
            tuple(Bucket(_dtype_name(d), int(s), int(n)) for d, s, n in raw["buckets"]),
        )

    def totals(self) -> dict[str, int]:
        """Elements of each dtype's run."""
        out: dict[str, int] = {}
        for b in self.buckets:
            out[b.dtype] = max(out.get(b.dtype, 0), b.start + b.numel)
        return out


def _dtype_name(name: str) -> str:
    if name not in _DTYPES:
        raise WeightSyncError(f"weight broadcast header names dtype {name!r}, not one of {sorted(_DTYPES)}")
    return name


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def wire_dtype(name: str, dtype: torch.dtype, engine: torch.dtype | None) -> torch.dtype:
    """The dtype canonical tensor ``name`` (of ``dtype`` on the learner) travels in to an engine
    holding weights in ``engine`` (None: as it is): the engine's dtype for it, never wider than
    the learner's, so the receiver's copy into the engine casts exactly as a colocated load."""
    if engine is None or not dtype.is_floating_point:
        return dtype
    held = engine_dtype(name, engine)
    return held if held.itemsize < dtype.itemsize else dtype


def plan_chunk(
    chunk: Mapping[str, torch.Tensor], bucket_bytes: int, engine: torch.dtype | None = None
) -> Header:
    """The header of a chunk: its tensors in their wire dtypes (``wire_dtype``) end to end per
    dtype (dtypes by name, tensors in the chunk's order), each dtype's run cut into buckets of at
    most ``bucket_bytes``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    entries, totals = [], {}
    for name, t in chunk.items():
        dtype = _dtype_name(str(wire_dtype(name, t.dtype, engine)).removeprefix("torch."))
        entries.append(Entry(name, dtype, tuple(t.shape), totals.get(dtype, 0)))
        totals[dtype] = totals.get(dtype, 0) + t.numel()
    buckets = []
    for dtype in sorted(totals):
        cap = max(1, bucket_bytes // _DTYPES[dtype].itemsize)
        buckets += [Bucket(dtype, s, min(cap, totals[dtype] - s)) for s in range(0, totals[dtype], cap)]
    return Header(tuple(entries), tuple(buckets))


def wire_device(group: Group) -> torch.device:
    if group.pg.name() == "nccl":  # untested on GPU
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _take(group: Group, t: torch.Tensor, p2p: bool) -> torch.Tensor:
    """Receive ``t`` from the root: its broadcast, or (``p2p``) a message to this rank alone."""
    return group.recv(t, 0) if p2p else group.broadcast(t)


def _recv_frame(group: Group, device: torch.device, p2p: bool = False) -> torch.Tensor:
    return _take(group, torch.empty(FRAME_LEN, dtype=torch.int64, device=device), p2p).cpu()


def _frame(version: int, kind: int, index: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([MAGIC, version, kind, index, nbytes], dtype=torch.int64, device=device)


@dataclass(frozen=True)
class Sliced:
    """The split sync's layout when engine ranks hold slices (vLLM TP > 1): each rollout rank's
    ``EngineShard`` in sync-group order (group rank i + 1 holds ``shards[i]``), and the model, whose
    KV heads and vocabulary the slices follow (moe_rl/weights/engine_shard.py)."""

    shards: tuple[EngineShard, ...]
    model: ModelConfig

    def of(self, dst: int) -> tuple[EngineShard, ModelConfig]:
        """Sync-group rank ``dst``'s shard and the model (``engine_slice``'s arguments)."""
        return self.shards[dst - 1], self.model


class WeightSender:
    """The root's side of one sync: ``send`` each chunk, then ``finish`` (the end marker) or
    ``abort``; a caller that stops without either leaves the receivers to time out (what a dead
    root does). ``engine``: the rollout engine's dtype (``ENGINE_DTYPES[rollout.dtype]``), which
    the wire dtypes follow (None: as they are). ``sliced``: each rollout rank is sent only its
    engine shard's slices, every message point to point; None: every message a broadcast."""

    def __init__(
        self,
        group: Group,
        version: int,
        bucket_bytes: int = 64 << 20,
        engine: torch.dtype | None = None,
        sliced: Sliced | None = None,
    ) -> None:
        if group.rank != 0:
            raise ValueError(f"the weight broadcast's root is sync-group rank 0, not {group.rank}")
        if sliced is not None and len(sliced.shards) != group.size - 1:
            raise ValueError(f"{len(sliced.shards)} engine shards for {group.size - 1} rollout ranks")
        self.group, self.version, self.bucket_bytes, self.engine = group, version, bucket_bytes, engine
        self.sliced = sliced
        self.device = wire_device(group)
        self.chunks = self.buckets = 0
        self.received = [0] * (group.size - 1)  # bytes each rollout rank was sent
        self.wait_s = 0.0  # the first frame's broadcast (send_sync adds its wait for the receivers to join)

    @property
    def nbytes(self) -> int:
        """The bytes of the sync one rollout rank received (the most any did)."""
        return max(self.received, default=0)

    def _put(self, t: torch.Tensor, dst: int | None) -> None:
        self.group.broadcast(t) if dst is None else self.group.send(t, dst)

    def _targets(self) -> list[int | None]:
        return [None] if self.sliced is None else list(range(1, self.group.size))

    def send(self, chunk: Mapping[str, torch.Tensor]) -> None:
        for dst in self._targets():
            part = chunk if dst is None else engine_slice(chunk, *self.sliced.of(dst))
            nbytes = self._send_to(part, dst)
            for r in range(len(self.received)) if dst is None else [dst - 1]:
                self.received[r] += nbytes
        self.chunks += 1

    def _send_to(self, chunk: Mapping[str, torch.Tensor], dst: int | None) -> int:
        """Frame, header and buckets of one chunk to ``dst`` (None: everyone); its bytes."""
        header = plan_chunk(chunk, self.bucket_bytes, self.engine)
        data = header.encode()
        t0 = time.perf_counter()
        # a gloo broadcast moves data only once every receiver posted its receive: the first frame
        # waits for receivers not yet joined (in a run they joined at send_sync's tell_last)
        self._put(_frame(self.version, CHUNK, self.chunks, len(data), self.device), dst)
        if self.chunks == 0 and dst in (None, 1):
            self.wait_s = time.perf_counter() - t0
        self._put(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), dst)
        flat = [chunk[e.name].detach().reshape(-1) for e in header.entries]
        nbytes = 0
        for dtype in sorted({e.dtype for e in header.entries}):
            idx = [i for i, e in enumerate(header.entries) if e.dtype == dtype]
            starts = [header.entries[i].offset for i in idx]
            for b in (b for b in header.buckets if b.dtype == dtype):
                bucket = _pack([flat[i] for i in idx], starts, b.start, b.start + b.numel, _DTYPES[dtype])
                self._put(bucket.to(self.device).view(torch.uint8), dst)
                self.buckets += 1
                nbytes += bucket.numel() * bucket.element_size()
        return nbytes

    def finish(self, kind: int = END) -> None:
        for dst in self._targets():
            self._put(_frame(self.version, kind, self.chunks, 0, self.device), dst)

    def abort(self) -> None:
        self.finish(ABORT)


def _pack(flat: list[torch.Tensor], starts: list[int], lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements [lo, hi) of the run ``flat`` laid end to end (``starts``: each piece's offset) in
    ``dtype``: the piece itself when one contiguous piece of that dtype is the whole bucket, else
    one bucket-sized tensor (the cast happens in the copy)."""
    first = bisect_right(starts, lo) - 1
    pieces = []
    for i in range(first, len(flat)):
        s = starts[i]
        if s >= hi:
            break
        pieces.append(flat[i][max(lo - s, 0) : min(hi - s, flat[i].numel())])
    if len(pieces) == 1 and pieces[0].is_contiguous() and pieces[0].dtype == dtype:
        return pieces[0]
    return torch.cat(pieces, out=torch.empty(hi - lo, dtype=dtype, device=pieces[0].device))


def broadcast_weights(
    chunks: Iterable[Mapping[str, torch.Tensor]],
    group: Group,
    version: int,
    bucket_bytes: int = 64 << 20,
    engine: torch.dtype | None = None,
    sliced: Sliced | None = None,
) -> dict[str, float]:
    """On the root (sync-group rank 0 = learner rank 0): send every chunk of ``chunks``
    (``learner.iter_canonical_layers()``, which the other learner ranks consume too) as weight
    version ``version``, each tensor in its wire dtype for an engine of dtype ``engine``
    (``wire_dtype``), then the end marker; ``sliced``: each rollout rank only its engine shard's
    slices (``WeightSender``). If the stream raises, the receivers are told (ABORT) before the
    error goes on. Returns the sync's metrics (docs/design.md 15.2)."""
    t0 = time.perf_counter()
    sender = WeightSender(group, version, bucket_bytes, engine, sliced)
    it = iter(chunks)
    while True:
        try:
            chunk = next(it)
        except StopIteration:
            break
        except Exception:
            sender.abort()
            raise
        try:
            sender.send(chunk)
        except RuntimeError as e:  # the group's error: a receiver is gone or stopped reading
            raise WeightSyncError(
                f"weight broadcast of version {version} failed at chunk {sender.chunks}: a rollout "
                f"rank stopped receiving ({one_line(e)})"
            ) from e
        del chunk
    sender.finish()
    return {
        "weight_sync/version": float(version),
        "weight_sync/bytes": float(sender.nbytes),
        "weight_sync/chunks": float(sender.chunks),
        "weight_sync/buckets": float(sender.buckets),
        "time/weight_broadcast_s": time.perf_counter() - t0,
        "time/weight_broadcast_wait_s": sender.wait_s,
    }


class WeightStream:
    """A receiver's chunks of one sync, in step with the root; must be read to its end marker."""

    def __init__(self, group: Group, version: int, first: torch.Tensor, p2p: bool = False) -> None:
        self.group, self.version, self.device, self.p2p = group, version, wire_device(group), p2p
        self.received, self.done, self.nbytes = 0, False, 0  # nbytes: bucket bytes received so far
        self._next: torch.Tensor | None = first  # the frame receive_weights read to learn the version

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.done:
            raise StopIteration
        frame = self._next if self._next is not None else self._recv_frame()
        self._next = None
        magic, version, kind, index, nbytes = (int(x) for x in frame.tolist())
        where = f"weight broadcast of version {self.version}"
        if magic != MAGIC or version != self.version or index != self.received:
            raise WeightSyncError(
                f"{where} out of step after {self.received} chunks: got a frame of version {version}, "
                f"chunk {index} (magic {magic:#x})"
            )
        if kind == END:
            self.done = True
            _OPEN.pop(self.group, None)
            raise StopIteration
        if kind == ABORT:
            _OPEN.pop(self.group, None)
            raise WeightSyncError(f"{where} aborted by the learner after {self.received} chunks")
        chunk = self._guarded(lambda: self._recv_chunk(nbytes))
        self.received += 1
        return chunk

    def _recv_frame(self) -> torch.Tensor:
        return self._guarded(lambda: _recv_frame(self.group, self.device, self.p2p))

    def _guarded(self, fn):
        try:
            return fn()
        except RuntimeError as e:  # the group's timeout, or the root's connection closed
            _OPEN.pop(self.group, None)
            raise WeightSyncError(
                f"weight broadcast of version {self.version} broke off after {self.received} chunks, "
                f"before its end marker ({one_line(e)})"
            ) from e

    def _recv_chunk(self, nbytes: int) -> dict[str, torch.Tensor]:
        raw = _take(self.group, torch.empty(nbytes, dtype=torch.uint8, device=self.device), self.p2p)
        header = Header.decode(raw.cpu().numpy().tobytes())
        runs = {d: torch.empty(n, dtype=_DTYPES[d], device=self.device) for d, n in header.totals().items()}
        for b in header.buckets:
            _take(self.group, runs[b.dtype][b.start : b.start + b.numel].view(torch.uint8), self.p2p)
        self.nbytes += sum(b.numel * _DTYPES[b.dtype].itemsize for b in header.buckets)
        return {
            e.name: runs[e.dtype][e.offset : e.offset + _numel(e.shape)].view(e.shape) for e in header.entries
        }


def receive_weights(group: Group, sliced: bool = False) -> tuple[int, Iterator[dict[str, torch.Tensor]]]:
    """On every sync-group member but the root: wait for the next sync and return its version and
    its chunks, to be read to the end in step with the root (``engine.load_weights`` takes the
    iterator as it is; ``PendingWeights`` stages it). ``sliced``: the root sends this rank its
    engine shard's slices point to point (``Sliced``), not broadcasts."""
    if group.rank == 0:
        raise ValueError("receive_weights runs on the rollout ranks; sync-group rank 0 is the root")
    left = _OPEN.get(group)
    if left is not None:
        raise WeightSyncError(
            f"the weight stream of version {left.version} was left after {left.received} chunks, "
            "before its end marker: read every stream to its end"
        )
    try:
        first = _recv_frame(group, wire_device(group), sliced)
    except RuntimeError as e:  # the group's timeout: no sync began
        raise WeightSyncError(f"no weight broadcast began within the group's timeout ({one_line(e)})") from e
    stream = WeightStream(group, int(first[1]), first, sliced)
    _OPEN[group] = stream
    return stream.version, stream


class PendingWeights:
    """Receive now, apply at the next safe point (the double buffer of a rollout rank).

    ``receive`` (blocking) or ``receive_in_background`` (a thread) stages a whole sync on the host;
    ``apply`` at a safe point loads the newest complete one into the engine in one
    ``load_weights`` of a dict (checked whole before any weight changes) and returns its version,
    or None with nothing staged. A receive error surfaces at the next ``apply`` or ``wait``."""

    def __init__(self) -> None:
        self.version: int | None = None  # the version the engine holds (None: none applied yet)
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def receive(self, group: Group, expect: int | None = None, sliced: bool = False) -> int:
        """Receive one sync into host buffers (the whole stream is read, in step with the root,
        before a wrong version is refused); ``sliced``: as ``receive_weights``."""
        version, chunks = receive_weights(group, sliced)
        named = {n: t.cpu() for chunk in chunks for n, t in chunk.items()}
        if expect is not None and version != expect:
            raise WeightSyncError(f"weight broadcast carried version {version}, this rank expected {expect}")
        with self._lock:
            self._staged = (version, named)
        return version

    def receive_in_background(self, group: Group, expect: int | None = None, sliced: bool = False) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("PendingWeights: a receive is already running")

        def run() -> None:
            try:
                self.receive(group, expect, sliced)
            except BaseException as e:  # handed to the owner's thread at apply / wait
                self._error = e

        self._thread = threading.Thread(target=run, name="weight-receive", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the background receive (if any) has finished; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    @property
    def receiving(self) -> bool:
        """A background receive is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def ready(self) -> bool:
        """A complete sync is staged (the engine does not hold it yet)."""
        return self._staged is not None

    def apply(self, engine: RolloutEngine) -> int | None:
        """At a safe point (the engine is between generate calls or decode steps): load the
        staged sync, if one is complete, and return its version; else None."""
        staged = self.take()
        if staged is None:
            return None
        version, named = staged
        engine.load_weights(named)
        self.version = version
        return version

    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The staged sync as (version, named tensors), handed over whole (an ``UpdateSource``
        passes it to the engine between decode steps); None with nothing staged. The caller
        applies it: ``version`` is not updated here."""
        self._raise()
        with self._lock:
            staged, self._staged = self._staged, None
        return staged

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e
