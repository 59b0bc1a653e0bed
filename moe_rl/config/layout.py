"""Layout arithmetic of a parallel config, the pure half of ``moe_rl.dist.ParallelDims`` (which holds
the groups built from it): no torch import, so the config loader validates a layout on any
machine. World = TP x PP x DP; experts live on EP x expert-TP ranks of every stage
(expert-DP = world / (EP x ETP x PP)); under TP the vocab-parallel output, the attention heads and
the MLPs split over TP, the experts' MLPs over expert-TP. Takes ``ModelConfig`` /
``ParallelConfig`` (duck-typed: ``moe_rl.config.run`` imports this module)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.checks import check
from moe_rl.errors import ConfigError

if TYPE_CHECKING:
    from moe_rl.config.model import ModelConfig, ParallelConfig


def data_parallel_size(par: ParallelConfig) -> int:
    """DP = learner ranks / (TP x PP)."""
    return par.learner_ranks // (par.tensor_parallel * par.pipeline_parallel)


def pipeline_stage_layers(num_layers: int, par: ParallelConfig) -> tuple[int, ...]:
    """Decoder layers of each pipeline stage, as megatron splits them: the first / last stage
    take ``layers_in_first_stage`` / ``layers_in_last_stage`` when set, the middle stages the rest
    evenly. ValueError (naming the numbers) when they do not split."""
    pp, first, last = par.pipeline_parallel, par.layers_in_first_stage, par.layers_in_last_stage
    if pp == 1:
        return (num_layers,)
    middle_stages = pp - (first > 0) - (last > 0)
    middle_layers = num_layers - first - last
    if (
        middle_layers < 0
        or (middle_stages == 0) != (middle_layers == 0)
        or (middle_stages and middle_layers % middle_stages)
    ):
        ends = f" after {first} on the first and {last} on the last stage" if first or last else ""
        raise ValueError(
            f"{num_layers} layers{ends} do not split evenly over {middle_stages} "
            f"{'middle ' if first or last else ''}pipeline stages"
        )
    each = middle_layers // middle_stages if middle_stages else 0
    return tuple(first if (s == 0 and first) else last if (s == pp - 1 and last) else each for s in range(pp))


def check_tied_embeddings(m: ModelConfig, p: ParallelConfig) -> None:
    """Tied embeddings only with PP = 1 (ConfigError naming the key otherwise).

    With PP > 1, megatron-core 0.16.1 keeps a copy of the tied matrix on the last stage in step
    through ``.cuda()`` and an embedding-group all-reduce: that does not run on CPU/gloo, so it is
    neither built nor tested here."""
    check(
        not (m.tie_word_embeddings and p.pipeline_parallel > 1),
        "model.tie_word_embeddings",
        f"true with parallel.pipeline_parallel={p.pipeline_parallel} is not supported (the embedding "
        "and the lm_head would live on different stages): use parallel.pipeline_parallel=1",
    )


def check_layout(m: ModelConfig, p: ParallelConfig) -> None:
    """Sizes that must divide for megatron to build the layout, each refused (ConfigError) naming
    its keys and numbers."""
    tp, pp, ep, etp = p.tensor_parallel, p.pipeline_parallel, p.expert_parallel, p.expert_tp
    check(
        m.num_experts % ep == 0,
        "parallel.expert_parallel",
        f"{ep} does not divide model.num_experts {m.num_experts}",
    )
    for key in ("num_query_groups", "num_attention_heads", "vocab_size", "ffn_hidden_size"):
        check(
            getattr(m, key) % tp == 0,
            "parallel.tensor_parallel",
            f"{tp} does not divide model.{key} {getattr(m, key)}",
        )
    check(
        m.moe_ffn_hidden_size % etp == 0,
        "parallel.expert_tensor_parallel",
        f"{etp} does not divide model.moe_ffn_hidden_size {m.moe_ffn_hidden_size}",
    )
    n = p.learner_ranks
    # with parallel.rollout_ranks the layout divides the learner ranks, not the world
    ranks, world = (
        (f"{n} ranks", f"parallel.nproc {n}")
        if not p.rollout_ranks
        else (
            f"{n} learner ranks",
            f"the {n} learner ranks (parallel.nproc {p.nproc} - parallel.rollout_ranks {p.rollout_ranks})",
        )
    )
    check(
        n % (tp * pp) == 0,
        "parallel.nproc" if not p.rollout_ranks else "parallel.rollout_ranks",
        f"{ranks} are not a multiple of tensor_parallel x pipeline_parallel = {tp} x {pp}",
    )
    check(
        n % (ep * etp * pp) == 0,
        "parallel.expert_parallel",
        f"expert_parallel x expert_tensor_parallel x pipeline_parallel = {ep} x {etp} x {pp} "
        f"does not divide {world}",
    )
    check_tied_embeddings(m, p)
    if pp > 1:
        try:
            stages = pipeline_stage_layers(m.num_layers, p)
        except ValueError as e:
            raise ConfigError(
                f"config key 'parallel.pipeline_parallel': {e} (model.num_layers, "
                f"parallel.layers_in_first_stage / layers_in_last_stage)"
            ) from None
        # routing replay and the router monitor run per stage: every stage needs a router
        check(
            m.first_k_dense < stages[0],
            "model.first_k_dense",
            f"{m.first_k_dense} dense layers leave pipeline stage 0 (layers 0..{stages[0] - 1}) "
            f"without a MoE layer",
        )
