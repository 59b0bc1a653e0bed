"""Subprocess scenarios for the megatron_patches behaviour tests (not collected by pytest).

    python _mcore_cpu_scenario.py patched  OUT.json   # apply_all, train, distopt save/load
    python _mcore_cpu_scenario.py ablation OUT.json   # leave patches out, record the errors

Each mode runs in its own process so that the pytest process is never patched. One process
per mode amortises the ~10 s megatron import over several checks. The entry point is guarded
by ``if __name__ == "__main__"`` because dist_checkpointing.save spawns a multiprocessing
Manager, which re-imports __main__; keep module-level imports to the standard library so that
re-import is cheap.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

VOCAB, SEQ, BATCH, NUM_EXPERTS = 64, 16, 2, 4
# fully_reshardable gathers over the gloo DP group only in its mem-efficient variant
OPT_CKPT_META = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
}


def init_dist(tmp: Path) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp / 'dist_store'}", rank=0, world_size=1
    )
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
        num_layers=2, hidden_size=32, num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2, add_bias_linear=False, params_dtype=torch.float32,
        hidden_dropout=0.1, attention_dropout=0.1,  # exercise the RNG tracker's fork
        bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ)


def batch() -> tuple[Any, Any]:
    import torch

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    return ids, torch.arange(SEQ).expand(BATCH, -1)


def forward_backward(model: Any) -> float:
    ids, pos = batch()
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    return float(loss)


def wrap_ddp(model: Any) -> Any:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
        bucket_size=None,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp: Any) -> Any:
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1.0, bf16=False, fp16=False,
        use_distributed_optimizer=True, params_dtype=torch.float32,
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


def rng_snapshot() -> Any:
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return torch.get_rng_state(), dict(get_cuda_rng_tracker().get_states())


def rng_restore(snapshot: Any) -> None:
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(snapshot[0])
    get_cuda_rng_tracker().set_states(dict(snapshot[1]))


def expect_error(fn: Any) -> dict[str, str]:
    """Run ``fn``; return the exception it raised as {type, message} (or 'no error')."""
    try:
        fn()
    except Exception as err:  # the point is to record whatever upstream raises
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": "none", "message": "no error"}


# ---------------------------------------------------------------- mode: patched


def check_apply_all() -> dict[str, Any]:
    import numpy as np
    import torch

    import megatron_patches
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    applied = megatron_patches.apply_all(cuda_available=False)
    targets = (torch.cuda.current_device, torch.Tensor.type, DistributedOptimizer.load_state_dict)
    again = megatron_patches.apply_all(cuda_available=False)
    same = all(a is b for a, b in zip(targets, (
        torch.cuda.current_device, torch.Tensor.type, DistributedOptimizer.load_state_dict)))
    from megatron.core.transformer.moe import moe_utils

    splits = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    return {
        "applied": applied, "applied_again": again, "idempotent_targets": same,
        "a2a_numpy": isinstance(splits, np.ndarray),
        "type_outside_optimizer": torch.zeros(1).type(),
        "check_all_after_apply": megatron_patches.check_all(),
    }


def train(result: dict[str, Any]) -> tuple[Any, Any, Any]:
    seed_all()
    model = build_model()
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp)
    before = [p.detach().clone() for p in model.parameters()]
    result["losses"] = [train_step(ddp, opt) for _ in range(3)]
    result["num_params_changed"] = sum(
        int(not b.equal(p.detach())) for b, p in zip(before, model.parameters()))
    result["num_params"] = len(before)
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


def step_report(opt: Any) -> dict[str, Any]:
    steps = [s["step"] for s in adam_states(opt)]
    return {"values": sorted({float(s) for s in steps}), "num": len(steps),
            "num_distinct_tensors": len({id(s) for s in steps})}


def max_diff(xs: list[Any], ys: list[Any]) -> float:
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(xs, ys))


def checkpoint_roundtrip(result: dict[str, Any], model: Any, ddp: Any, opt: Any, tmp: Path) -> None:
    ckpt = tmp / "ckpt"
    result["steps_at_save"] = step_report(opt)
    save(model, opt, ckpt)
    model2, ddp2, opt2, loaded_opt_sd = load_fresh(ckpt)
    result["steps_after_load"] = step_report(opt2)
    result["exp_avg_max_diff_after_load"] = max_diff(
        [s["exp_avg"] for s in adam_states(opt)], [s["exp_avg"] for s in adam_states(opt2)])
    result["param_max_diff_after_load"] = max_diff(
        list(model.parameters()), list(model2.parameters()))
    # one more step on both runs from the same RNG state: resumed == uninterrupted
    snapshot = rng_snapshot()
    loss_a = train_step(ddp, opt)
    rng_restore(snapshot)
    loss_b = train_step(ddp2, opt2)
    result["next_loss_uninterrupted_vs_resumed"] = [loss_a, loss_b]
    result["param_max_diff_after_next_step"] = max_diff(
        list(model.parameters()), list(model2.parameters()))
    result["steps_after_next_step"] = step_report(opt2)
    result["upstream_load_still_aliases"] = upstream_aliases(opt2, loaded_opt_sd)


def upstream_aliases(opt: Any, loaded_opt_sd: Any) -> bool:
    """Call upstream load_state_dict (under our wrapper) directly: is `step` still shared?"""
    inners = inner_optimizers(opt)
    if len(inners) != 1:
        return False  # per-optimizer state splitting is ChainedOptimizer's job; not modelled
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    DistributedOptimizer.load_state_dict.__wrapped__(inners[0], loaded_opt_sd)
    report = step_report(opt)
    return report["num"] > 1 and report["num_distinct_tensors"] == 1


def run_patched(tmp: Path) -> dict[str, Any]:
    result = check_apply_all()
    init_dist(tmp)
    model, ddp, opt = train(result)
    checkpoint_roundtrip(result, model, ddp, opt, tmp)
    return result


# ---------------------------------------------------------------- mode: ablation


LEFT_OUT = ("rng_tracker", "cuda_stream", "te_names", "tensor_type_strings")


def run_ablation(tmp: Path) -> dict[str, Any]:
    """Apply all but LEFT_OUT, hit each one's upstream error, apply it, and go on."""
    import megatron_patches

    for name in megatron_patches.CPU_PATCHES + megatron_patches.ALWAYS_PATCHES:
        if name not in LEFT_OUT:
            megatron_patches.get_patch(name).apply()
    init_dist(tmp)
    result: dict[str, Any] = {}
    result["rng_tracker"] = expect_error(seed_all)
    megatron_patches.get_patch("rng_tracker").apply()
    seed_all()
    result["cuda_stream"] = expect_error(build_model)
    megatron_patches.get_patch("cuda_stream").apply()
    model = build_model()
    result["te_names"] = expect_error(lambda: forward_backward(model))
    megatron_patches.get_patch("te_names").apply()
    model.zero_grad(set_to_none=True)
    ddp = wrap_ddp(model)
    result["tensor_type_strings"] = expect_error(lambda: build_optimizer(ddp))
    megatron_patches.get_patch("tensor_type_strings").apply()
    result["loss_after_all_applied"] = train_step(ddp, build_optimizer(ddp))
    result["apply_all_after"] = megatron_patches.apply_all(cuda_available=False)
    return result


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        result = {"patched": run_patched, "ablation": run_ablation}[mode](Path(tmp))
        import torch.distributed as dist

        dist.destroy_process_group()
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
