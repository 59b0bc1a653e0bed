"""Subprocess scenarios for the megatron_patches behaviour tests (not collected by pytest).

    python _mcore_cpu_scenario.py patched  OUT.json   # apply_all, train, distopt save/load
    python _mcore_cpu_scenario.py ablation OUT.json   # leave patches out, record the errors

Each mode runs in its own process so that the pytest process is never patched, and groups
many checks to pay the ~10 s megatron import once. The entry point is guarded by
``if __name__ == "__main__"`` because dist_checkpointing.save spawns a multiprocessing Manager,
which re-imports __main__ (upstream; moe-rl's save_results_queue patch removes it): module-level
imports are stdlib only, so that re-import is cheap.
Results go to OUT.json; test_patches_behaviour.py asserts on them.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB, SEQ, BATCH, NUM_EXPERTS = 64, 16, 2, 4
NUM_TRAIN_STEPS = 3
# fully_reshardable gathers over the gloo DP group only in its mem-efficient variant
OPT_CKPT_META = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
}
Result = dict[str, Any]


# ---------------------------------------------------------------- building blocks


def init_dist(tmp: Path) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def seed_all(seed: int = 1234) -> None:
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build_model() -> Any:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=2,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2,
        add_bias_linear=False,
        params_dtype=torch.float32,
        hidden_dropout=0.1,
        attention_dropout=0.1,  # exercise the RNG tracker's fork
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def forward_backward(model: Any) -> float:
    import torch

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    loss = model(ids, torch.arange(SEQ).expand(BATCH, -1), None, labels=ids).float().mean()
    loss.backward()
    return loss.item()


def wrap_ddp(model: Any) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=True,
        bucket_size=None,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp: Any) -> Any:
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.0,
        clip_grad=1.0,
        bf16=False,
        fp16=False,
        use_distributed_optimizer=True,
        params_dtype=torch.float32,
    )
    return get_megatron_optimizer(config, [ddp])


def train_step(ddp: Any, opt: Any) -> float:
    from megatron.core.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = forward_backward(ddp)
    finalize_model_grads([ddp])
    ok, _, _ = opt.step()
    assert ok, "optimizer step skipped"
    return loss


def inner_optimizers(opt: Any) -> list[Any]:
    return list(getattr(opt, "chained_optimizers", [opt]))


def adam_states(opt: Any) -> list[dict[str, Any]]:
    return [s for o in inner_optimizers(opt) for s in o.optimizer.state.values()]


def step_report(opt: Any) -> Result:
    steps = [s["step"] for s in adam_states(opt)]
    return {
        "values": sorted({float(s) for s in steps}),
        "num": len(steps),
        "num_distinct_tensors": len({id(s) for s in steps}),
    }


def max_diff(xs: list[Any], ys: list[Any]) -> float:
    assert len(xs) == len(ys) > 0
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(xs, ys, strict=True))


def rng_snapshot() -> Any:
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return torch.get_rng_state(), dict(get_cuda_rng_tracker().get_states())


def rng_restore(snapshot: Any) -> None:
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(snapshot[0])
    get_cuda_rng_tracker().set_states(dict(snapshot[1]))


def expect_error(fn: Callable[[], Any]) -> dict[str, str]:
    """Run ``fn``; return what it raised: type, message, and the innermost megatron frame."""
    try:
        fn()
    except Exception as err:  # the point is to record whatever upstream raises
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "megatron/core/" in f.filename]
        where = ""
        if frames:
            where = f"{frames[-1].filename.split('megatron/core/')[-1]}:{frames[-1].name}"
        return {"type": type(err).__name__, "message": str(err), "where": where}
    return {"type": "none", "message": "no error", "where": ""}


# ---------------------------------------------------------------- mode: patched


def check_apply_all() -> Result:
    import numpy as np
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.moe import moe_utils

    import megatron_patches

    def targets() -> tuple[Any, ...]:
        return (
            torch.cuda.current_device,
            torch.Tensor.type,
            DistributedOptimizer.load_state_dict,
            moe_utils.maybe_move_tensor_to_cpu,
        )

    # what a CUDA process gets (only the always-on fixes), then the CPU shims on top
    applied_as_if_cuda = megatron_patches.apply_all(cuda_available=True)
    applied = megatron_patches.apply_all(cuda_available=False)
    first = targets()
    again = megatron_patches.apply_all(cuda_available=False)
    splits = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    return {
        "applied_as_if_cuda": applied_as_if_cuda,
        "applied": applied,
        "applied_again": again,
        "idempotent_targets": all(a is b for a, b in zip(first, targets(), strict=True)),
        "a2a_numpy": isinstance(splits, np.ndarray),
        "type_outside_optimizer": torch.zeros(1).type(),
        "check_all_after_apply": megatron_patches.check_all(),
    }


def train(result: Result) -> tuple[Any, Any, Any]:
    seed_all()
    model = build_model()
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp)
    before = [p.detach().clone() for p in model.parameters()]
    result["losses"] = [train_step(ddp, opt) for _ in range(NUM_TRAIN_STEPS)]
    result["num_params"] = len(before)
    result["num_params_changed"] = sum(
        int(not b.equal(p.detach())) for b, p in zip(before, model.parameters(), strict=True)
    )
    result["optimizers"] = [type(o).__name__ for o in inner_optimizers(opt)]
    return model, ddp, opt


def save(model: Any, opt: Any, ckpt: Path) -> None:
    from megatron.core import dist_checkpointing

    model_sd = model.sharded_state_dict(prefix="")
    opt_sd = opt.sharded_state_dict(model_sd, metadata=OPT_CKPT_META)
    ckpt.mkdir()
    dist_checkpointing.save({"model": model_sd, "optimizer": opt_sd}, str(ckpt))


def load_fresh(ckpt: Path) -> tuple[Any, Any, Any, Any]:
    """A new model + optimizer (empty Adam state) loaded from ``ckpt``, as a resumed run does."""
    from megatron.core import dist_checkpointing

    model = build_model()
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp)
    model_sd = model.sharded_state_dict(prefix="")
    opt_sd = opt.sharded_state_dict(model_sd, is_loading=True, metadata=OPT_CKPT_META)
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": opt_sd}, str(ckpt))
    model.load_state_dict(loaded["model"], strict=True)
    opt.load_state_dict(loaded["optimizer"])
    return model, ddp, opt, loaded["optimizer"]


def checkpoint_roundtrip(result: Result, model: Any, ddp: Any, opt: Any, tmp: Path) -> None:
    result["steps_at_save"] = step_report(opt)
    save(model, opt, tmp / "ckpt")
    result["save_results_queue"] = results_queue_after_save()
    model2, ddp2, opt2, loaded_opt_sd = load_fresh(tmp / "ckpt")
    result["steps_after_load"] = step_report(opt2)
    result["exp_avg_max_diff_after_load"] = max_diff(
        [s["exp_avg"] for s in adam_states(opt)], [s["exp_avg"] for s in adam_states(opt2)]
    )
    result["param_max_diff_after_load"] = max_diff(list(model.parameters()), list(model2.parameters()))
    # one more step on both runs from the same RNG state: resumed must equal uninterrupted
    snapshot = rng_snapshot()
    loss_uninterrupted = train_step(ddp, opt)
    rng_restore(snapshot)
    loss_resumed = train_step(ddp2, opt2)
    result["next_loss_uninterrupted_vs_resumed"] = [loss_uninterrupted, loss_resumed]
    result["param_max_diff_after_next_step"] = max_diff(list(model.parameters()), list(model2.parameters()))
    result["steps_after_next_step"] = step_report(opt2)
    result["upstream_still_broken"] = upstream_still_broken(opt2, loaded_opt_sd)


def results_queue_after_save() -> Result:
    """save_results_queue: the queue the save used, the processes it left (upstream's spawn
    Manager would be one), and the guards: pickling it, a put from a forked process."""
    import multiprocessing as mp
    import pickle

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    q = filesystem_async._results_queue
    left = [p.name for p in mp.active_children()]
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def put_from_child() -> None:
        send.send(expect_error(lambda: q.put({})))

    child = ctx.Process(target=put_from_child)
    child.start()
    from_child = recv.recv()
    child.join()
    return {
        "type": type(q).__name__,
        "children_left": left,
        "pickle": expect_error(lambda: pickle.dumps(q)),
        "put_from_child": from_child,
        "empty_after_child": q.empty(),
    }


def upstream_still_broken(opt: Any, loaded_opt_sd: Any) -> Result:
    """Call the upstream callables under our wrappers (``__wrapped__``): are the bugs there?

    Each entry is a "Remove when" tripwire: when upstream fixes a bug, its entry flips.
    Runs last: it leaves ``opt`` with upstream's shared ``step``.
    """
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DistOpt
    from megatron.core.transformer.moe import moe_utils

    (inner,) = inner_optimizers(opt)  # EP=1: one DistributedOptimizer
    fresh_model = build_model()
    (fresh,) = inner_optimizers(build_optimizer(wrap_ddp(fresh_model)))
    fresh_sd = fresh_model.sharded_state_dict(prefix="")
    model_param = next(iter(inner.model_param_group_index_map))
    no_step = {
        k: v for k, v in inner._get_main_param_and_optimizer_states(model_param).items() if k != "step"
    }
    # the loaders call it under no_grad
    set_states = torch.no_grad()(DistOpt._set_main_param_and_optimizer_states.__wrapped__)
    cpu_splits = moe_utils.maybe_move_tensor_to_cpu.__wrapped__(torch.tensor([1]), as_numpy=True)
    broken = {
        "a2a_splits": torch.is_tensor(cpu_splits),
        "distopt_ckpt_i": expect_error(
            lambda: DistOpt.sharded_state_dict.__wrapped__(fresh, fresh_sd, True, None, OPT_CKPT_META)
        ),
        "distopt_ckpt_ii": expect_error(lambda: set_states(inner, model_param, no_step)),
    }
    DistOpt.load_state_dict.__wrapped__(inner, loaded_opt_sd)
    report = step_report(opt)
    broken["distopt_step_alias"] = report["num"] > 1 and report["num_distinct_tensors"] == 1
    return broken


def run_patched(tmp: Path) -> Result:
    result = check_apply_all()
    init_dist(tmp)
    model, ddp, opt = train(result)
    checkpoint_roundtrip(result, model, ddp, opt, tmp)
    return result


# ---------------------------------------------------------------- mode: ablation

# CPU shims left out at the start, in the order the scenario runs into their errors
LEFT_OUT = (
    "rng_tracker",
    "current_device",
    "cuda_stream",
    "causal_mask",
    "te_names",
    "cuda_factories",
    "tensor_type_strings",
)


def left_out_stage(result: Result, name: str, fn: Callable[[], Any]) -> None:
    """Run ``fn`` while patch ``name`` is left out, record its error, then apply ``name``."""
    import megatron_patches

    result[name] = expect_error(fn)
    megatron_patches.get_patch(name).apply()


def run_ablation(tmp: Path) -> Result:
    """Apply all but LEFT_OUT; hit each left-out patch's upstream error, apply it, go on."""
    import megatron_patches

    for name in megatron_patches.ALL_PATCHES:
        if name not in LEFT_OUT:
            megatron_patches.get_patch(name).apply()
    init_dist(tmp)
    result: Result = {}
    left_out_stage(result, "rng_tracker", seed_all)
    seed_all()
    left_out_stage(result, "current_device", build_model)
    left_out_stage(result, "cuda_stream", build_model)
    model = build_model()
    left_out_stage(result, "causal_mask", lambda: forward_backward(model))
    left_out_stage(result, "te_names", lambda: forward_backward(model))
    model.zero_grad(set_to_none=True)
    ddp = wrap_ddp(model)
    left_out_stage(result, "cuda_factories", lambda: build_optimizer(ddp))
    left_out_stage(result, "tensor_type_strings", lambda: build_optimizer(ddp))
    result["loss_after_all_applied"] = train_step(ddp, build_optimizer(ddp))
    result["apply_all_after"] = megatron_patches.apply_all(cuda_available=False)
    return result


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    run = {"patched": run_patched, "ablation": run_ablation}[mode]
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp))
        import torch.distributed as dist

        dist.destroy_process_group()
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
