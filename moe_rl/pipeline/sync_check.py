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
sleeps, then no probe). vLLM with TP > 1 loads slices and is unchecked.
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
    name: str, sent: Mapping[str, int], held: Mapping[str, int], version: int
) -> SyncCheckError:
    """The one-line error for tensor ``name``."""
    if name not in sent:
        what = "the learner sent no such tensor (a missed bucket)"
    elif name not in held:
        what = "the engine holds no such tensor"
    else:
        what = (
            f"checksum {held[name]} != sent {sent[name]} (a wrong layout, a dropped chunk or a stale tensor)"
        )
    return SyncCheckError(f"weight sync check failed at sync {version}: engine tensor {name!r}: {what}")


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
    chunk completed, ``finish()`` raises on parts that never came); None: the canonical layout."""

    def __init__(
        self, dtype: torch.dtype, fp8: frozenset[str], on: bool, vocab_size: int, layout=None
    ) -> None:
        self.dtype, self.fp8, self.on, self.vocab_size, self.layout = dtype, fp8, on, vocab_size, layout
        self.sent: dict[str, torch.Tensor] = {}
        self.seconds = 0.0  # this sync's checksum and probe time, both sides

    def wrap(self, weights: Weights) -> Weights:
        """The learner's stream, checksummed as it passes (a new sync: the last one's sums go)."""
        self.sent, self.seconds = {}, 0.0
        if not self.on:
            return weights
        conv = self.layout() if self.layout is not None else None
        if isinstance(weights, Mapping):  # a dict stays one (an engine checks a dict whole first)
            self._sum(weights, conv)
            if conv is not None:
                conv.finish()
            return weights
        return self._summed(weights, conv)

    def _sum(self, chunk: Mapping[str, torch.Tensor], conv) -> None:
        t0 = time.perf_counter()  # the checksums alone, not the stream's gathers
        if conv is not None:  # the engine's layout; its dtypes are the converter's
            self.sent.update({n: checksum(t) for n, t in conv.feed(chunk).items()})
        else:
            self.sent.update({n: checksum(expected(n, t, self.dtype, self.fp8)) for n, t in chunk.items()})
        self.seconds += time.perf_counter() - t0

    def _summed(self, weights: Weights, conv):
        for chunk in weight_chunks(weights):
            self._sum(chunk, conv)
            yield chunk
        if conv is not None:
            conv.finish()

    def sent_ints(self) -> dict[str, int]:
        return as_ints(self.sent)

    def verify(self, engine, version: int) -> None:
        """Colocated: the engine's held weights against the sums of the stream just sent."""
        if not self.on or (held := held_sums(engine)) is None:
            return
        t0 = time.perf_counter()
        sent = self.sent_ints()
        self.seconds += time.perf_counter() - t0 + getattr(engine, "held_seconds", 0.0)
        name = first_mismatch(sent, held)
        if name is not None:
            raise mismatch_error(name, sent, held, version)

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
        return m

    def learner_logp(self, learner, micro_batch_size: int) -> torch.Tensor:
        """The learner's log-probs of the probe batch, fp32 [PROBE_ROWS, PROBE_LEN] on the host
        (column 0: 0); one forward-only pass, collective over the learner ranks."""
        tokens = probe_tokens(self.vocab_size)
        seq_lens = torch.full((PROBE_ROWS,), PROBE_LEN, dtype=torch.int64)
        out = learner.forward_logprobs(TrainBatch(tokens, seq_lens), 1.0, micro_batch_size)
        return out.stats.logp_BS.detach().float().cpu()


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


def send_checksums(group: Group, sent: Mapping[str, int], learner_logp: torch.Tensor) -> None:
    """Split, the root: after the weights, the count and the checksums (sorted names), then the
    learner's probe log-probs (fp32 [PROBE_ROWS, PROBE_LEN]) to every rollout rank."""
    names = sorted(sent)
    device = wire_device(group)
    group.broadcast(torch.tensor([len(names)], dtype=torch.int64, device=device))
    group.broadcast(torch.tensor([sent[n] for n in names], dtype=torch.int64, device=device))
    group.broadcast(learner_logp.to(device=device, dtype=torch.float32).contiguous())


def receive_sums(group: Group) -> tuple[list[int], torch.Tensor]:
    """Split, a rollout rank: the root's checksums of the sync just received and its probe
    log-probs (``send_checksums``)."""
    device = wire_device(group)
    count = int(group.broadcast(torch.zeros(1, dtype=torch.int64, device=device))[0])
    sums = group.broadcast(torch.zeros(count, dtype=torch.int64, device=device)).cpu().tolist()
    logp = group.broadcast(torch.zeros((PROBE_ROWS, PROBE_LEN), dtype=torch.float32, device=device))
    return sums, logp.cpu()


def held_sums(engine) -> dict[str, int] | None:
    """The engine's checksums of what it holds after the sync just done: its own
    (``held_checksums``: vLLM, computed in its worker, docs/vllm.md 11), or those of its
    ``held_weights`` (the built-in engine); None for an engine that exposes neither."""
    if (own := getattr(engine, "held_checksums", None)) is not None:
        return own()
    held_weights = getattr(engine, "held_weights", None)
    return None if held_weights is None else as_ints(checksums(held_weights()))


def verify_held(engine, sums: list[int], version: int) -> None:
    """The engine's held weights (sorted names) against the root's ``sums``; an engine that
    exposes none (``held_sums``) is not checked here."""
    held = held_sums(engine)
    if held is None:
        return
    names = sorted(held)
    if len(names) != len(sums):
        raise SyncCheckError(
            f"weight sync check failed at sync {version}: the learner sent {len(sums)} tensors, "
            f"the engine holds {len(names)}"
        )
    sent = dict(zip(names, sums))
    name = first_mismatch(sent, held)
    if name is not None:
        raise mismatch_error(name, sent, held, version)


def check_received(group: Group, engine, version: int) -> tuple[float, torch.Tensor]:
    """Split, a rollout rank after its load: the root's checksums against its engine's; seconds,
    and the learner's probe log-probs of the weights just loaded (``probe_engine`` scores them)."""
    t0 = time.perf_counter()
    sums, learner_logp = receive_sums(group)
    verify_held(engine, sums, version)
    return time.perf_counter() - t0 + getattr(
        engine, "held_seconds", 0.0
    ), learner_logp  # vLLM: its worker's too
