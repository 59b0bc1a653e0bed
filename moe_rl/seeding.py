"""Seeds derived from the run seed: a resumed run redraws the same prompts and samples without
storing any RNG state."""

from __future__ import annotations

# the independent random streams of one step
PROMPTS, GENERATE, VALIDATE = 0, 1, 2


def step_seed(seed: int, step: int, dp_rank: int, stream: int) -> int:
    """A seed per (run seed, step, data-parallel rank, stream)."""
    return ((seed * 1_000_003 + step) * 1_009 + dp_rank) * 8 + stream
