"""The vLLM rollout engine (``rollout.engine=vllm``); only engine.py imports vllm."""
