"""Verifiable tasks: tokenizer, prompt sources and rewards.

Import from the defining modules (``moe_rl.tasks.task.build_prompt_source``,
``moe_rl.tasks.rewards.score``, ...): this package imports nothing, so the reward workers that
import ``moe_rl.tasks.text_rewards`` start without torch.
"""
