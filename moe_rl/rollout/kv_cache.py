"""The built-in engine's KV cache (moe_rl/rollout/builtin_model.py).

Shape suffix legend: B sequences, G key/value groups, S key positions (slots), D head dim,
C + R the MLA latent and roped shared key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.config import ModelConfig


@dataclass
class KVCache:
    """Preallocated keys/values of every layer; slots [0, length) are filled.

    All rows share the slot index (prompts are left-padded, decode steps are aligned), so one
    ``length`` serves the batch; which slots a row may attend to is the caller's key mask.
    GQA: k / v, one tensor per layer, [B, G, S_max, D] in the engine dtype.
    MLA: k holds the latent per layer, [B, 1, S_max, C + R] (C = kv_lora_rank normalised latent,
    then the R = qk_rope_head_dim roped shared key, what vLLM's MLA cache keeps); v is empty. Keys
    and values are re-expanded from it each step: MLA's cache is the point of MLA.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        if cfg.mla:
            shape = (batch, 1, capacity, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            return cls(
                k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)], v=[]
            )
        shape = (batch, cfg.num_query_groups, capacity, cfg.head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)],
        )

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[2])

    def repeat_rows(self, n: int) -> KVCache:
        """A cache with every row repeated n times in place (row b -> rows b*n .. b*n+n-1).

        Lets the engine prefill each distinct prompt once and fan it out to its n samples.
        """
        return KVCache(
            k=[t.repeat_interleave(n, dim=0) for t in self.k],
            v=[t.repeat_interleave(n, dim=0) for t in self.v],
            length=self.length,
        )
