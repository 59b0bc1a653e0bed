"""The checked weight sync (``rollout.sync_check``, off by default; docs/design.md 14.4).

After every sync the engine's weights are compared with what the learner sent, tensor by tensor:
the learner checksums each tensor of its stream as the engine must hold it (engine dtype; FP8:
quantize -> dequantize recomputed on the learner, ``moe_rl/weights/checksum.py``), the engine
checksums what it holds after the load. A tensor whose checksums differ (a wrong layout such as
a permuted expert order, a chunk the engine dropped, a tensor its load left stale) or that one side
lacks fails the job with one line naming it (``SyncCheckError``).

Then a fixed probe batch (``PROBE_ROWS`` token sequences from a fixed seed) is scored by the engine
and by the learner with the same weights, and ``sync/probe_k3`` = mean_t(rho - 1 - log rho),
rho = pi_learner / pi_engine, is logged (the max over the data-parallel ranks). Colocated, the
engine is in this process: the check runs right after the load and the probe inside the sync phase
(one forward-only learner pass while its weights are on the device); the value on step t's metrics
is of W_{t+1}, the weights that step's sync loaded. Split (``parallel.rollout_ranks``), the root
broadcasts after the weights its checksums and its probe log-probs (``send_checksums``: the learner
ranks run the probe forward together, PROBE_ROWS x PROBE_LEN fp32 travel), and each rollout rank,
after its load, checks its engine (``check_received``) and scores the probe with the weights just
loaded (``probe_engine``); it computes the k3 and sends it with every batch after it (the
``RolloutMessage``'s engine metrics, with ``sync/probe_version``: the learner update it is of).
Sync and one_step_off: the weights that step's batch was generated with (one_step_off: one update
behind the learner). Async: the engine takes updates between decode steps and may skip one; it is
checked at its first poll after the load and probed once its request ends (the engine idle, still
holding that update), so a step's value is of the newest update its rollout rank had loaded when
it sent the batch.

Engines that expose their weights (``held_weights``: the built-in engine) or their checksums of
them (``held_checksums``: vLLM, computed in its worker over what it received, in its own layout,
which the learner computes with ``layout``: moe_rl/rollout/vllm/sync_sums.py) are checked; the
probe needs ``token_logprobs`` (both engines; vLLM: ``prompt_logprobs``, None while its KV cache
sleeps, then no probe). vLLM with TP > 1: each TP rank's worker holds its shard, so the sums are
per shard, in that rank's layout (``layout(tp_rank)``: its slices, fused as its vLLM parameters
hold them). On rollout ranks the root computes every TP rank's row and sends them all; each rank
checks its own row. Colocated, each learner rank computes the one row of the TP rank its own
engine worker is (``own``) from the slices it hands that worker, and checks it there. Per shard,
not gathered: the rank's slices are what it was sent, and rebuilding vLLM's full tensors from the
fused shards would need the inverse of every fusion.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from moe_rl.metrics import Max
from moe_rl.pipeline.placement import Group
from moe_rl.pipeline.weight_broadcast import wire_device
from moe_rl.rollout.base import Weights, weight_chunks
from moe_rl.types import TrainBatch
from moe_rl.weights.checksum import as_ints, checksum, checksums, expected, first_mismatch

PROBE_ROWS, PROBE_LEN, PROBE_SEED = 4, 16, 0x9B0B  # the fixed probe batch: rows x tokens, its seed


class SyncCheckError(RuntimeError):
    """The engine's weights after a sync are not what the learner sent (one line, naming a tensor)."""


def mismatch_error(
    name: str, sent: Mapping[str, int], held: Mapping[str, int], version: int, where: str = ""
) -> SyncCheckError:
    """The one-line error for tensor ``name`` (``where``: the engine shard's, e.g. " (TP rank 1 of 2)")."""
    if name not in sent:
        what = "the learner sent no such tensor (a missed bucket)"
    elif name not in held:
        what = "the engine holds no such tensor"
    else:
        what = (
            f"checksum {held[name]} != sent {sent[name]} (a wrong layout, a dropped chunk or a stale tensor)"
        )
    return SyncCheckError(
        f"weight sync check failed at sync {version}: engine tensor {name!r}{where}: {what}"
    )


def probe_tokens(vocab_size: int) -> torch.Tensor:
    """The fixed probe batch: int64 [PROBE_ROWS, PROBE_LEN], the same at every sync and on every rank."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (PROBE_ROWS, PROBE_LEN), generator=g, dtype=torch.int64)


def probe_k3(learner_logp_BS: torch.Tensor, engine_logp_BS: torch.Tensor) -> float:
    """mean_t(rho - 1 - log rho), log rho = learner - engine, over the scored columns 1..S-1."""
    log_rho = learner_logp_BS[:, 1:].double() - engine_logp_BS[:, 1:].double().to(learner_logp_BS.device)
    return float((log_rho.exp() - 1 - log_rho).mean())


class SyncCheck:
    """A learner rank's side. ``dtype``: the engine's (``rollout.dtype``); ``fp8``: the names the
    engine holds in FP8 (empty without ``rollout.quantization=fp8``); ``on``: ``rollout.sync_check``.
    ``layout``: a new converter per sync from the canonical stream to the engine's own layout
    (vLLM: ``rollout.vllm.sync_sums.layout_for``; its ``feed(chunk)`` returns the engine tensors a
    chunk completed, ``finish()`` raises on parts that never came); None: the canonical layout.
    ``tp``: the engine ranks' TP size when each holds a shard (vLLM TP > 1; 1: ``sent`` alone).
    ``own``: colocated, the TP rank of this rank's engine worker: its row alone (``layout(own)``),
    and the errors name its shard; None with ``tp`` > 1 (the split root): a row per TP rank
    (``layout(r)``), ``sent_ints(r)`` their sums."""

    def __init__(
        self,
        dtype: torch.dtype,
        fp8: frozenset[str],
        on: bool,
        vocab_size: int,
        layout=None,
        tp: int = 1,
        own: int | None = None,
    ) -> None:
        self.dtype, self.fp8, self.on, self.vocab_size, self.layout = dtype, fp8, on, vocab_size, layout
        self.tp, self.own = tp, own
        self.rows: list[dict[str, torch.Tensor]] = [{}]  # per TP rank: its tensors' sums
        self.seconds = 0.0  # this sync's checksum and probe time, both sides
        self.agreed = 0  # tensors whose sums agreed at the last verify (sync/check_tensors)

    @property
    def sent(self) -> dict[str, torch.Tensor]:
        """The sums of the sync just sent (TP rank 0's where each rank holds a shard)."""
        return self.rows[0]

    def wrap(self, weights: Weights) -> Weights:
        """The learner's stream, checksummed as it passes (a new sync: the last one's sums go)."""
        self.rows, self.seconds = [{}], 0.0
        if not self.on:
            return weights
        if self.layout is None:
            convs = [None]
        elif self.own is not None:  # colocated TP > 1: this rank's worker's shard
            convs = [self.layout(self.own)]
        else:
            convs = [self.layout(r) for r in range(self.tp)] if self.tp > 1 else [self.layout()]
        self.rows = [{} for _ in convs]
        if isinstance(weights, Mapping):  # a dict stays one (an engine checks a dict whole first)
            self._sum(weights, convs)
            _finish(convs)
            return weights
        return self._summed(weights, convs)

    def _sum(self, chunk: Mapping[str, torch.Tensor], convs: list) -> None:
        t0 = time.perf_counter()  # the checksums alone, not the stream's gathers
        for sent, conv in zip(self.rows, convs):
            if conv is not None:  # the engine's layout; its dtypes are the converter's
                sent.update({n: checksum(t) for n, t in conv.feed(chunk).items()})
            else:
                sent.update({n: checksum(expected(n, t, self.dtype, self.fp8)) for n, t in chunk.items()})
        self.seconds += time.perf_counter() - t0

    def _summed(self, weights: Weights, convs: list):
        for chunk in weight_chunks(weights):
            self._sum(chunk, convs)
            yield chunk
        _finish(convs)

    def sent_ints(self, tp_rank: int = 0) -> dict[str, int]:
        return as_ints(self.rows[tp_rank])

    def verify(self, engine, version: int) -> None:
        """Colocated: the engine's held weights (with TP > 1 its worker's shard) against the sums
        of the stream just sent."""
        if not self.on or (held := held_sums(engine)) is None:
            return
        t0 = time.perf_counter()
        sent = self.sent_ints()
        self.seconds += time.perf_counter() - t0 + getattr(engine, "held_seconds", 0.0)
        name = first_mismatch(sent, held)
        if name is not None:
            where = shard_words(self.own, self.tp) if self.own is not None else ""
            raise mismatch_error(name, sent, held, version, where)
        self.agreed = len(held)

    def probe(self, engine, learner, micro_batch_size: int) -> dict:
        """Colocated: the probe batch's engine-vs-learner k3 and this sync's check time."""
        if not self.on:
            return {}
        m = {}
        t0 = time.perf_counter()
        # None: the engine cannot score now (vLLM on GPU whose KV cache sleeps through the sync),
        # the same on every rank, so the learner's collective forward is skipped on all of them
        engine_logp = engine_logprobs(engine, self.vocab_size)
        if engine_logp is not None:
            k3 = probe_k3(self.learner_logp(learner, micro_batch_size), engine_logp)
            m["sync/probe_k3"] = Max(torch.tensor(k3, dtype=torch.float64))
            m["time/sync_probe_s"] = Max(torch.tensor(time.perf_counter() - t0, dtype=torch.float64))
        m["time/sync_check_s"] = Max(torch.tensor(self.seconds, dtype=torch.float64))
        if self.agreed:
            m["sync/check_tensors"] = Max(torch.tensor(float(self.agreed), dtype=torch.float64))
        return m

    def learner_logp(self, learner, micro_batch_size: int) -> torch.Tensor:
        """The learner's log-probs of the probe batch, fp32 [PROBE_ROWS, PROBE_LEN] on the host
        (column 0: 0); one forward-only pass, collective over the learner ranks."""
        tokens = probe_tokens(self.vocab_size)
        seq_lens = torch.full((PROBE_ROWS,), PROBE_LEN, dtype=torch.int64)
        out = learner.forward_logprobs(TrainBatch(tokens, seq_lens), 1.0, micro_batch_size)
        return out.stats.logp_BS.detach().float().cpu()


def _finish(convs: list) -> None:
    for conv in convs:
        if conv is not None:
            conv.finish()


def engine_logprobs(engine, vocab_size: int) -> torch.Tensor | None:
    """The engine's log-probs of the probe batch with the weights it holds now; None for an
    engine that cannot score (no ``token_logprobs``, or vLLM on GPU asleep)."""
    score = getattr(engine, "token_logprobs", None)
    return score(probe_tokens(vocab_size)) if score is not None else None


def probe_engine(engine, learner_logp: torch.Tensor, vocab_size: int) -> float | None:
    """Split, a rollout rank: the probe's k3 of its engine (the weights it holds now) against the
    learner's log-probs of the same weights (``receive_sums``); None where the engine cannot score."""
    engine_logp = engine_logprobs(engine, vocab_size)
    return None if engine_logp is None else probe_k3(learner_logp, engine_logp.cpu())


def send_checksums(group: Group, rows: list[Mapping[str, int]], learner_logp: torch.Tensor) -> None:
    """Split, the root: after the weights, the number of rows (one per TP rank where each engine
    rank holds a shard, else one) and of sums per row, the rows' checksums (each by sorted names),
    then the learner's probe log-probs (fp32 [PROBE_ROWS, PROBE_LEN]) to every rollout rank."""
    names = [sorted(sent) for sent in rows]
    if len({len(n) for n in names}) != 1:
        raise ValueError(f"weight sync check: the TP ranks' sums differ in count: {[len(n) for n in names]}")
    device = wire_device(group)
    group.broadcast(torch.tensor([len(rows), len(names[0])], dtype=torch.int64, device=device))
    sums_RN = [[sent[n] for n in row] for sent, row in zip(rows, names)]
    group.broadcast(torch.tensor(sums_RN, dtype=torch.int64, device=device).reshape(-1))
    group.broadcast(learner_logp.to(device=device, dtype=torch.float32).contiguous())


def receive_sums(group: Group, tp_rank: int = 0) -> tuple[list[int], torch.Tensor]:
    """Split, a rollout rank: the root's checksums of the sync just received (the row of TP rank
    ``tp_rank`` where the root sent one per TP rank) and its probe log-probs (``send_checksums``)."""
    device = wire_device(group)
    rows, count = group.broadcast(torch.zeros(2, dtype=torch.int64, device=device)).tolist()
    sums_RN = group.broadcast(torch.zeros(rows * count, dtype=torch.int64, device=device)).view(rows, count)
    logp = group.broadcast(torch.zeros((PROBE_ROWS, PROBE_LEN), dtype=torch.float32, device=device))
    if rows > 1 and tp_rank >= rows:
        raise ValueError(f"weight sync check: sums for {rows} TP ranks, this is TP rank {tp_rank}")
    return sums_RN[tp_rank if rows > 1 else 0].cpu().tolist(), logp.cpu()


def held_sums(engine) -> dict[str, int] | None:
    """The engine's checksums of what it holds after the sync just done: its own
    (``held_checksums``: vLLM, computed in its worker, docs/vllm.md 11), or those of its
    ``held_weights`` (the built-in engine); None for an engine that exposes neither."""
    if (own := getattr(engine, "held_checksums", None)) is not None:
        return own()
    held_weights = getattr(engine, "held_weights", None)
    return None if held_weights is None else as_ints(checksums(held_weights()))


def verify_held(engine, sums: list[int], version: int, where: str = "") -> int:
    """The engine's held weights (sorted names) against the root's ``sums``; the number of tensors
    that agreed (0: an engine that exposes none, ``held_sums``, is not checked here). ``where``:
    the engine shard's words for the error (``shard_words``)."""
    held = held_sums(engine)
    if held is None:
        return 0
    names = sorted(held)
    if len(names) != len(sums):
        raise SyncCheckError(
            f"weight sync check failed at sync {version}: the learner sent {len(sums)} tensors, "
            f"the engine{where} holds {len(names)}"
        )
    sent = dict(zip(names, sums))
    name = first_mismatch(sent, held)
    if name is not None:
        raise mismatch_error(name, sent, held, version, where)
    return len(names)


def shard_words(tp_rank: int, tp: int) -> str:
    """How an error names the engine shard: " (TP rank 1 of 2)"; nothing for a whole engine."""
    return f" (TP rank {tp_rank} of {tp})" if tp > 1 else ""


def check_received(
    group: Group, engine, version: int, tp_rank: int = 0, tp: int = 1
) -> tuple[float, torch.Tensor, int]:
    """Split, a rollout rank after its load (TP rank ``tp_rank`` of ``tp`` where each engine rank
    holds a shard): the root's checksums against its engine's; seconds (vLLM: its worker's
    checksums too), the learner's probe log-probs of the weights just loaded (``probe_engine``
    scores them) and the number of tensors that agreed."""
    t0 = time.perf_counter()
    sums, learner_logp = receive_sums(group, tp_rank)
    agreed = verify_held(engine, sums, version, shard_words(tp_rank, tp))
    return time.perf_counter() - t0 + getattr(engine, "held_seconds", 0.0), learner_logp, agreed
