"""The learner layout (``Layout``) and the parameters one GPU of a pipeline stage holds.

The layout follows megatron-core: world = TP x PP x DP for the dense
parameters; within each pipeline stage the experts are split over EP x ETP ranks (expert tensor
parallelism splits each expert's matrices, megatron's ``expert_tensor_parallel_size``) and
replicated over expert-DP = world / (EP x ETP x PP). Uneven pipeline stages follow megatron's
``num_layers_in_first/last_pipeline_stage``: the middle stages split the remaining layers evenly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from moe_rl.config import ModelConfig, ParallelConfig
from moe_rl.config.layout import pipeline_stage_layers
from moe_rl.memory.sizes import attention_params


@functools.lru_cache(maxsize=4096)
def _stage_layers(world: int, pp: int, first: int, last: int, num_layers: int) -> tuple[int, ...]:
    # cached: the layout search asks again for the same few splits (330k calls for one 6-node
    # recipe, each a validated ParallelConfig: half of `choose_layout`'s time)
    par = ParallelConfig(
        nproc=world,
        pipeline_parallel=pp,
        expert_parallel=1,
        layers_in_first_stage=first if pp > 1 else 0,
        layers_in_last_stage=last if pp > 1 else 0,
    )
    return tuple(pipeline_stage_layers(num_layers, par))


@dataclass(frozen=True)
class Layout:
    """A learner layout over ``world`` GPUs. ``etp`` 0 becomes TP (megatron's default);
    ``first`` / ``last`` 0 mean an even split (megatron's num_layers_in_first/last_pipeline_stage
    unset). With both set the PP - 2 middle stages split the remaining layers evenly."""

    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 0
    first: int = 0
    last: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "etp", self.etp or self.tp)

    @classmethod
    def of(cls, p: ParallelConfig) -> Layout:
        return cls(
            p.nproc,
            p.tensor_parallel,
            p.pipeline_parallel,
            p.expert_parallel,
            p.expert_tensor_parallel,
            p.layers_in_first_stage,
            p.layers_in_last_stage,
        )

    @property
    def expert_tp(self) -> int:
        return self.etp

    @property
    def dp(self) -> int:
        """Data-parallel size of the dense parameters: world / (TP x PP)."""
        return self.world // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard: world / (EP x ETP x PP)."""
        return self.world // (self.ep * self.expert_tp * self.pp)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers of each pipeline stage (megatron's rule); ValueError when they do not split."""
        if self.pp == 1 and (self.first or self.last):
            raise ValueError("layers in the first/last stage need pipeline_parallel > 1")
        return list(_stage_layers(self.world, self.pp, self.first, self.last, num_layers))

    def problems(self, m: ModelConfig) -> list[str]:
        """What megatron would refuse, one line each; empty when the layout is valid for ``m``."""
        tp, etp, out = self.tp, self.expert_tp, []
        if self.world % (tp * self.pp):
            return [f"TP*PP = {tp * self.pp} does not divide {self.world} GPUs"]
        if m.mla and m.transformer_impl == "te" and tp > 1:  # learner/build.py refuses it at build
            out.append(f"TP {tp}: MLA with model.transformer_impl=te is built with TP 1 only")
        for key in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
            if getattr(m, key) % tp:
                out.append(f"TP {tp} does not divide model.{key} {getattr(m, key)}")
        if m.moe_ffn_hidden_size % etp:
            out.append(f"ETP {etp} does not divide model.moe_ffn_hidden_size {m.moe_ffn_hidden_size}")
        if m.num_experts % self.ep:
            out.append(f"EP {self.ep} does not divide model.num_experts {m.num_experts}")
        if (self.world // self.pp) % (self.ep * etp):
            out.append(f"EP*ETP = {self.ep * etp} does not divide DP*TP = {self.world // self.pp}")
        try:
            stages = self.stage_layers(m.num_layers)
        except ValueError as e:
            out.append(str(e))
        else:  # routing replay and the router monitor run per stage (moe_rl/config/layout.py)
            if m.first_k_dense >= stages[0]:
                out.append(f"{m.first_k_dense} dense layers leave pipeline stage 0 without a MoE layer")
        return out

    def describe(self, num_layers: int) -> str:
        text = f"TP {self.tp} x EP {self.ep} x ETP {self.expert_tp} x PP {self.pp}"
        return text + (
            f" ({'/'.join(map(str, self.stage_layers(num_layers)))} layers)" if self.pp > 1 else ""
        )


def stage_params(m: ModelConfig, lay: Layout, stage: int, layers: list[int]) -> tuple[float, float]:
    """(dense, expert) parameters on one GPU of pipeline stage ``stage``.

    Dense: attention (GQA q/k/v/o and their biases; MLA's projections, which TP > 1 only builds
    with the local spec, which splits them all) and dense-MLP and shared-expert matrices split over
    TP (column / row parallel), the input embedding (first stage) and the output layer (last
    stage, with the final norm) split over TP by vocabulary rows; norms, routers, the expert bias
    and Qwen2-MoE's shared-expert gate replicated on every TP rank (megatron's TopKRouter weight
    is not split). Experts: the stage's MoE layers, whole experts over EP, each expert's matrices
    over ETP."""
    H, D, V, E = m.hidden_size, m.head_dim, m.vocab_size, m.num_experts
    start, n = sum(layers[:stage]), layers[stage]
    n_dense = max(0, min(start + n, m.first_k_dense) - start)
    n_moe = n - n_dense
    norms = (m.q_lora_rank + m.kv_lora_rank) if m.mla else (2 * D if m.qk_layernorm else 0)  # q/k or latent
    split = attention_params(m) - norms
    replicated = 2 * H + norms  # input + pre-MLP norms, q/k (MLA: latent) norms
    S = m.moe_shared_expert_ffn_hidden_size
    per_moe = E * H + (E if m.moe_router_expert_bias else 0) + 3 * H * S / lay.tp
    per_moe += H if m.moe_shared_expert_gate else 0
    dense = n * (split / lay.tp + replicated) + n_moe * per_moe + n_dense * 3 * H * m.ffn_hidden_size / lay.tp
    if stage == 0:
        dense += V * H / lay.tp
    if stage == lay.pp - 1:
        dense += V * H / lay.tp + H
    return dense, n_moe * E * 3 * H * m.moe_ffn_hidden_size / (lay.ep * lay.expert_tp)
