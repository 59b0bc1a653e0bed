"""The multi-turn loop: every trajectory is ONE token sequence, prompt then (assistant turn, tool
reply) repeated, built append-only over the engine's ``generate`` (docs/agentic.md 2).

Each turn the still-running trajectories' whole sequences go to ``generate`` (n = 1) and only what
is new is kept: the turn's sampled tokens, their log-probs and weight versions, and the route rows
from the last row kept so far to the new end. An engine with ``omits_route_prefix`` (vLLM) is asked
for those rows only (``route_starts``: the rows kept; docs/vllm.md 10), so a conversation's route
bytes grow with its length, not with the square of its turns. Earlier tokens and route rows are
never replaced, re-rendered or re-tokenized; the tool reply is rendered and tokenized alone and
appended.

What the batch says about each token (``RolloutBatch``): ``response_mask_BS`` is true on sampled
(assistant) tokens only, so the learner's loss trains only them while its forward runs over
everything; ``turn_BS`` gives each token's turn (0 the prompt, k >= 1 assistant turn k and the tool
reply after it: a reply token is one with turn >= 1 outside the mask). Injected tokens carry log-prob
0 and version 0 (never used as sampled). Their route rows are the next turn's prefill, computed by the
engine at that turn's weights as prompt rows are; a row no forward computed is MISSING and routed
natively by the learner, never expert 0.

Every end is counted by reason (``agent/end/<reason>``, ``END_REASONS``): ``answer`` (the
environment ended it, by default on a final answer, with its reward), ``max_turns`` (turn
``agent.max_turns`` made a tool call, which is not run, or the environment replied to it),
``truncated`` (a turn hit ``agent.max_turn_tokens`` without its stop token), ``context`` (the next
turn or reply would pass ``agent.max_total_tokens``), ``tool_budget`` (the replies would pass
``agent.max_tool_tokens_total``). Only ``answer`` has a non-zero reward.

``route_return``: ``append`` (the loop) or ``full``, the contrast scripts/bench_agent.py measures
(as verl's loop does: every turn takes the whole sequence's rows and replaces the kept ones, so
route bytes grow with turns squared). ``verify`` (``routing.verify``): on the steps it is due, a
sample of the batch is checked against one full prefill (moe_rl/routing/verify.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_rl.agentic.environment import Environment, TaskRow
from moe_rl.agentic.formats import ToolFormat
from moe_rl.agentic.tools import ERROR_KINDS, ToolRunner
from moe_rl.config import AgentConfig
from moe_rl.errors import RouteError
from moe_rl.fsutil import write_atomic
from moe_rl.metrics import Max, Mean, Sum, truncate_metrics_file
from moe_rl.routing.provenance import PROV_BYTES, Provenance
from moe_rl.routing.record import missing_id
from moe_rl.routing.verify import VerifyPlan, verify_batch
from moe_rl.types import Prompt, RolloutBatch, SamplingParams

END_REASONS = ("answer", "max_turns", "truncated", "context", "tool_budget")
ROUTE_RETURNS = ("append", "full")  # AgentLoop.route_return (module docstring)
_TURN_SEED = 0x9E3779B97F4A7C15  # decorrelates the turns' sampling streams


@dataclass
class Trajectory:
    """One conversation as it grows: per-turn chunks of every per-token field, concatenated once."""

    task: TaskRow
    group: int
    prompt_len: int
    tokens: list[torch.Tensor]
    sampled: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    versions: list[torch.Tensor] = field(default_factory=list)
    turns: list[torch.Tensor] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    prov: list[Provenance] = field(default_factory=list)  # beside ``routes``, row for row
    length: int = 0
    routed: int = 0  # route rows kept so far (rows of positions [0, routed))
    route_bytes: int = 0  # bytes of route rows and their provenance taken from the engine, all turns
    turn: int = 0
    tool_tokens: int = 0
    generated: int = 0  # tokens the engine sampled, counted from its response lengths (not the mask)
    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    end: str = ""
    reward: float = 0.0
    transcript: list[str] = field(default_factory=list)

    def append(self, ids: torch.Tensor, sampled: bool, logp=None, version=None) -> None:
        n = int(ids.shape[0])
        self.tokens.append(ids)
        self.sampled.append(torch.full((n,), sampled, dtype=torch.bool))
        self.logprobs.append(logp if logp is not None else torch.zeros(n, dtype=torch.float32))
        self.versions.append(version if version is not None else torch.zeros(n, dtype=torch.int32))
        self.turns.append(torch.full((n,), self.turn, dtype=torch.int16))
        self.length += n


class AgentLoop:
    """Runs an environment's conversations on an engine (``rollout``) under ``agent.*``'s limits."""

    def __init__(
        self, env: Environment, fmt: ToolFormat, cfg: AgentConfig, max_new_tokens: int, max_seq_len: int
    ):
        self.env, self.fmt, self.cfg = env, fmt, cfg
        self.turn_tokens = cfg.max_turn_tokens or max_new_tokens
        self.max_total = cfg.max_total_tokens or max_seq_len
        self.log_path: Path | None = None  # set: every trajectory is appended there as a JSON line
        self.verify: VerifyPlan | None = None  # routing.verify (moe_rl/routing/verify.py)
        self.route_return = "append"

    def rollout(
        self,
        engine,
        prompts: list[Prompt],
        n: int,
        sampling: SamplingParams,
        seed: int,
        step: int = 0,
        updates=None,
    ) -> RolloutBatch:
        """n conversations per prompt (prompt-major, as ``generate``), turn by turn; the batch of
        ``moe_rl/types.py`` with ``turn_BS``, the environment's rewards and the agent metrics.
        ``updates``: async's in-flight weight updates (an ``UpdateSource``), handed to every
        turn's ``generate``: an update may land within a turn or between two, and each token
        keeps the version it was sampled with (``version_BS``)."""
        if sampling.return_dist or sampling.dvp.on:
            raise ValueError("the multi-turn loop does not return full distributions (DVP, exact-KL TRM)")
        trajs = [
            Trajectory(p.extra["env_task"], g, len(p.prompt_ids), [])
            for g, p in enumerate(prompts)
            for _ in range(n)
        ]
        for t, p in zip(trajs, [p for p in prompts for _ in range(n)]):
            t.append(torch.tensor(p.prompt_ids, dtype=torch.int64), False)
        turn_sampling = dataclasses.replace(sampling, max_new_tokens=self.turn_tokens)
        for turn in range(1, self.cfg.max_turns + 1):
            for t in trajs:  # a turn starts only when all of it fits
                if not t.end and t.length + self.turn_tokens > self.max_total:
                    t.end = "context"
            active = [t for t in trajs if not t.end]
            if not active:
                break
            seqs = [torch.cat(t.tokens).tolist() for t in active]
            turn_seed = (seed + turn * _TURN_SEED) % 2**63
            kw: dict = {} if updates is None else {"updates": updates}
            omit = getattr(engine, "omits_route_prefix", False) and self.route_return == "append"
            if omit:  # ask only for the route rows not kept yet (vLLM: routed_experts_prompt_start)
                kw["route_starts"] = [t.routed for t in active]
            out = engine.generate(seqs, 1, turn_sampling, seed=turn_seed, **kw)
            for i, t in enumerate(active):
                t.turn = turn
                self._take_turn(t, out, i, t.routed if omit else 0)
        batch = self._batch(trajs, self.fmt.tok.pad_id, step)
        if self.verify is not None and self.verify.due(step):  # the engine still holds the last weights
            batch.engine_metrics.update(verify_batch(engine, batch, self.verify, seed))
        return batch

    def _take_turn(self, t: Trajectory, out: RolloutBatch, i: int, sent_from: int = 0) -> None:
        """``sent_from``: the first row the engine sent (``route_starts``; 0: it sent every row)."""
        p, r = int(out.prompt_lens_B[i]), int(out.response_lens_B[i])
        ids = out.tokens_BS[i, p : p + r].cpu()
        version = out.version_BS[i, p : p + r].cpu() if out.version_BS is not None else None
        t.append(ids, True, out.logprobs_BS[i, p : p + r].cpu().float(), version)
        if out.routes[i].shape[0] != p + r - 1 - sent_from:
            raise RouteError(
                f"agent turn {t.turn}: the engine sent {out.routes[i].shape[0]} route rows from "
                f"position {sent_from} for {p + r} tokens"
            )
        first = t.routed if self.route_return == "append" else 0  # append-only: only rows not kept yet
        if first == 0:  # "full" (the bench's contrast) replaces every kept row with this turn's
            t.routes, t.prov = [], []
        a, b = first - sent_from, p + r - 1 - sent_from  # rows [first, p + r - 1) of the sequence
        rows = out.routes[i][a:b]
        t.routes.append(rows)
        t.route_bytes += rows.numel() * rows.element_size()
        if out.route_prov is not None:
            t.prov.append(out.route_prov[i].slice(a, b).with_turn(t.turn))
            t.route_bytes += PROV_BYTES * int(rows.shape[0])
        t.routed = p + r - 1
        t.generated += r
        text = self.fmt.tok.decode(ids)
        t.transcript.append(text)
        if not bool(out.finished_B[i]):
            t.end = "truncated"
            return
        message = self.fmt.parse(text, self.env.tools(t.task))
        if t.turn == self.cfg.max_turns and not message.answer:  # no turn would read the replies
            t.end = "max_turns"
            return
        result = self.env.step(t.task, message, self._runner(t))
        if result.done:
            t.end, t.reward = "answer", result.reward
            return
        if t.turn == self.cfg.max_turns:  # the environment answered an answer (feedback): no turn left
            t.end = "max_turns"
            return
        t.calls += len(result.replies)
        for r_ in result.replies:
            if r_.error:
                t.errors[r_.error] = t.errors.get(r_.error, 0) + 1
        reply = torch.tensor(self.fmt.reply_ids(result.replies), dtype=torch.int64)
        n = int(reply.shape[0])
        if self.cfg.max_tool_tokens_total and t.tool_tokens + n > self.cfg.max_tool_tokens_total:
            t.end = "tool_budget"
        elif t.length + n >= self.max_total:
            t.end = "context"
        else:
            t.append(reply, False)
            t.tool_tokens += n
            t.transcript.append("".join(f"[{r_.name}] {r_.content}" for r_ in result.replies))

    def _runner(self, t: Trajectory) -> ToolRunner:
        c = self.cfg
        return ToolRunner(self.env.tools(t.task), c.tool_timeout_s, c.max_tool_tokens, self.fmt.count_tokens)

    def log_to(self, path: Path, resume_step: int | None = None) -> None:
        """Append every trajectory (turn texts, end, reward, counts) to ``path`` as a JSON line. A
        resume at ``resume_step`` first drops the lines of steps >= it (written after the
        checkpoint, they are generated again), so the log holds each step once."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            write_atomic(path, "")  # a new run: not appended to an earlier run's log
        else:
            truncate_metrics_file(path, resume_step)
        self.log_path = path

    def _batch(self, trajs: list[Trajectory], pad_id: int, step: int) -> RolloutBatch:
        B = len(trajs)
        T_B = torch.tensor([t.length for t in trajs], dtype=torch.int64)
        S = int(T_B.max())

        def padded(chunks_B: list[torch.Tensor], fill, dtype) -> torch.Tensor:
            out = torch.full((B, S), fill, dtype=dtype)
            for b, chunks in enumerate(chunks_B):
                row = torch.cat(chunks).to(dtype)
                out[b, : row.shape[0]] = row
            return out

        mask_BS = padded([t.sampled for t in trajs], False, torch.bool)
        routes, provs = [], []
        for (
            t
        ) in trajs:  # rows no forward computed (none on this engine: the last token has no row) are MISSING
            rows = torch.cat(t.routes)
            short = t.length - 1 - rows.shape[0]
            if short > 0:
                rows = torch.cat([rows, rows.new_full((short, *rows.shape[1:]), missing_id(rows.dtype))])
            routes.append(rows)
            if t.prov:
                provs.append(Provenance.cat([*t.prov, Provenance.none(max(short, 0))]))
        prompt_B = torch.tensor([t.prompt_len for t in trajs], dtype=torch.int64)
        batch = RolloutBatch(
            tokens_BS=padded([t.tokens for t in trajs], pad_id, torch.int64),
            prompt_lens_B=prompt_B,
            response_lens_B=T_B - prompt_B,
            response_mask_BS=mask_BS,
            logprobs_BS=padded([t.logprobs for t in trajs], 0.0, torch.float32),
            routes=routes,
            route_prov=provs if len(provs) == len(trajs) else None,
            group_B=torch.tensor([t.group for t in trajs], dtype=torch.int64),
            finished_B=torch.tensor([t.end == "answer" for t in trajs]),
            version_BS=padded([t.versions for t in trajs], 0, torch.int32),
            turn_BS=padded([t.turns for t in trajs], 0, torch.int16),
            env_reward_B=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
            engine_metrics=self._metrics(trajs, mask_BS),
        )
        self._log(trajs, step)
        return batch

    def _metrics(self, trajs: list[Trajectory], mask_BS: torch.Tensor) -> dict:
        n = float(len(trajs))
        calls = float(sum(t.calls for t in trajs))
        failed = {k: float(sum(t.errors.get(k, 0) for t in trajs)) for k in ERROR_KINDS}
        turns = [float(t.turn) for t in trajs]
        return {
            "agent/turns_mean": Mean(sum(turns), n),
            "agent/turns_max": Max(max(turns)),
            "agent/tool_calls": Sum(calls),
            "agent/tool_success_rate": Mean(calls - sum(failed.values()), calls),
            "agent/assistant_tokens": Sum(float(mask_BS.sum())),
            "agent/tool_tokens": Sum(float(sum(t.tool_tokens for t in trajs))),
            "agent/route_bytes": Sum(float(sum(t.route_bytes for t in trajs))),
            **{f"agent/tool_errors/{k}": Sum(v) for k, v in failed.items()},
            **{f"agent/end/{r}": Sum(float(sum(t.end == r for t in trajs))) for r in END_REASONS},
        }

    def _log(self, trajs: list[Trajectory], step: int) -> None:
        if self.log_path is None:
            return
        with self.log_path.open("a", encoding="utf-8") as f:
            for t in trajs:
                rec = {
                    "step": step,
                    "question": t.task.question,
                    "answer": t.task.answer,
                    "turns": t.turn,
                    "end": t.end,
                    "reward": t.reward,
                    "tool_calls": t.calls,
                    "tool_errors": t.errors,
                    "assistant_tokens": t.generated,
                    "tool_tokens": t.tool_tokens,
                    "route_bytes": t.route_bytes,
                    "transcript": t.transcript,
                }
                f.write(json.dumps(rec) + "\n")
