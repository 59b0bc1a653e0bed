"""The vLLM rollout engine (``rollout.engine=vllm``), by job; only engine.py imports vllm, so this
package imports without it:

- env.py: which vLLM build runs on this machine, and what the CPU build refuses or forces;
- dvp_processor.py: DVP's logits processor and the safe sets read back from vLLM's log-probs;
- requests.py: the ``vllm.LLM`` arguments, one request per sample, outputs -> ``RolloutBatch``;
- transfer.py: weight sync (vLLM's weight-transfer API on GPU, the worker's reload on CPU);
- sync_sums.py: the checked sync's checksums, in vLLM's layout, on the learner and in the worker;
- engine.py: ``VllmEngine``, the one module that imports vllm (tests/test_style.py).

The pure config rules (what vLLM cannot give the learner) are ``moe_rl/config/vllm_rules.py``.
"""
