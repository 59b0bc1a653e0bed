"""The built-in engine's prefix cache (``rollout.prefix_cache_blocks`` > 0; docs/agentic.md 2.1): a
later turn of a conversation reuses the KV and the route rows of the tokens an earlier call fed, and
only prefills the tokens after them.

Blocks of ``rollout.prefix_block_tokens`` fed tokens are keyed by a hash chain over the sequence's
token blocks (block i's key hashes block i - 1's key and block i's tokens, as vLLM's prefix caching
does; the tokens are kept and compared too, so a hash collision is a miss, never a wrong hit). A
block holds its KV of every layer and, beside it, its route rows and their weight versions, so a hit
returns the rows of the forward that filled it (provenance ``PREFIX_HIT``). At most
``max_blocks`` blocks: the least recently used is evicted, KV and routes together. Every weight
load drops the whole cache, so a block from another weight version is never used (the version
stored per row is then always the engine's). Only calls without an in-flight update fill it.

Shape suffixes: G KV groups (1 for MLA's latent), T block tokens, D head dim, L MoE layers, K top-k.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from moe_rl.config import ModelConfig
from moe_rl.rollout.builtin import BuiltinEngine
from moe_rl.rollout.builtin_model import KVCache
from moe_rl.routing.provenance import COMPUTED, PREFIX_HIT


@dataclass
class Block:
    tokens: tuple[int, ...]
    k: list[torch.Tensor]  # per layer [G, T, D]
    v: list[torch.Tensor]  # per layer [G, T, D]; empty for MLA
    routes_TLK: torch.Tensor  # int32
    version_T: torch.Tensor  # int32, the weight version of the forward behind each row


def block_bytes(cfg: ModelConfig, block_tokens: int, elem_bytes: int) -> int:
    """Bytes one cached block holds: K and V of every layer (MLA: the latent only) in the engine's
    dtype, int32 route rows and int32 versions."""
    kv = cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.mla else 2 * cfg.num_query_groups * cfg.head_dim
    per_token = cfg.num_layers * kv * elem_bytes + 4 * len(cfg.moe_layers) * cfg.moe_router_topk + 4
    return block_tokens * per_token


class PrefixCache:
    """LRU blocks of KV and route rows keyed by the token-block hash chain (module docstring)."""

    def __init__(self, block_tokens: int, max_blocks: int) -> None:
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError(
                f"prefix cache needs block_tokens >= 1 and max_blocks >= 1, got {block_tokens}, {max_blocks}"
            )
        self.block_tokens, self.max_blocks = block_tokens, max_blocks
        self.blocks: OrderedDict[int, Block] = OrderedDict()
        self.hit_blocks = self.evicted = 0

    def keys(self, tokens: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        """(key, tokens) of every full block of ``tokens``, in order."""
        out, key, T = [], 0, self.block_tokens
        for i in range(len(tokens) // T):
            blk = tuple(tokens[i * T : (i + 1) * T])
            key = hash((key, blk))
            out.append((key, blk))
        return out

    def match(self, tokens: list[int]) -> list[Block]:
        """The cached blocks of the longest cached prefix of ``tokens`` (each one marked used)."""
        found = []
        for key, blk in self.keys(tokens):
            b = self.blocks.get(key)
            if b is None or b.tokens != blk:
                break
            self.blocks.move_to_end(key)
            found.append(b)
        self.hit_blocks += len(found)
        return found

    def insert(self, key: int, block: Block) -> None:
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return
        self.blocks[key] = block
        while len(self.blocks) > self.max_blocks:  # LRU: KV and routes leave together
            self.blocks.popitem(last=False)
            self.evicted += 1

    def clear(self) -> None:
        self.blocks.clear()


class PrefixCachedEngine(BuiltinEngine):
    """The built-in engine with a prefix cache: each distinct prompt's cached prefix is read from
    the cache and only its other tokens are prefilled (one forward per distinct prompt); after the
    call, the full blocks of every sequence's fed tokens are stored."""

    def __init__(self, model_cfg: ModelConfig, *, max_blocks: int, block_tokens: int = 16, **kw) -> None:
        super().__init__(model_cfg, **kw)
        self.prefix = PrefixCache(block_tokens, max_blocks)
        self._call_version = 0
        self.prefill_log: list[list[tuple[int, int]]] = []  # per call, per distinct prompt: (tokens, cached)

    def load_weights(self, weights, version=None):
        out = super().load_weights(weights, version)
        self.prefix.clear()  # blocks of the old weights are never read at the new ones
        return out

    def _prefill_forward(self, prompts, prompt_UP, positions_UP, valid_UP, cache_U, noise):
        U, P = prompt_UP.shape
        dev, T = self.device, self.prefix.block_tokens
        L, K = len(self.cfg.moe_layers), self.cfg.moe_router_topk
        ids_UPLK = torch.zeros((U, P, L, K), dtype=torch.int64, device=dev)
        ver_UP = torch.full((U, P), self.version, dtype=torch.int32, device=dev)
        src_UP = torch.full((U, P), COMPUTED, dtype=torch.uint8, device=dev)
        logits = []
        self._call_version = self.version
        self.prefill_log.append([])
        for u, p in enumerate(prompts):  # one forward per distinct prompt: cached lengths differ
            blocks = self.prefix.match(p[: len(p) - 1])  # at least the last token is fed: its logits
            c, off = len(blocks) * T, P - len(p)
            one = KVCache.allocate(self.cfg, 1, len(p), self.model.dtype, dev)
            for li in range(self.cfg.num_layers):
                if blocks:
                    one.k[li][0, :, :c] = torch.cat([b.k[li] for b in blocks], 1)
                    if one.v:
                        one.v[li][0, :, :c] = torch.cat([b.v[li] for b in blocks], 1)
            one.length = c
            self.prefill_log[-1].append((len(p), c))
            out = self.model.forward(
                torch.tensor(p[c:], dtype=torch.long, device=dev)[None],
                torch.arange(c, len(p), device=dev)[None],
                torch.ones((1, len(p)), dtype=torch.bool, device=dev),
                one,
                last_logits_only=True,
                noise=noise,
            )
            for li in range(self.cfg.num_layers):
                cache_U.k[li][u, :, off:P] = one.k[li][0]
                if one.v:
                    cache_U.v[li][u, :, off:P] = one.v[li][0]
            if blocks:
                ids_UPLK[u, off : off + c] = torch.cat([b.routes_TLK for b in blocks]).long()
                ver_UP[u, off : off + c] = torch.cat([b.version_T for b in blocks])
                src_UP[u, off : off + c] = PREFIX_HIT
            ids_UPLK[u, off + c :] = out.expert_ids_BTLK[0]
            logits.append(out.logits[0, -1])
        cache_U.length = P
        return ids_UPLK, torch.stack(logits), ver_UP, src_UP

    def _assemble(self, st, n, sampling):
        if self.version == self._call_version:  # no in-flight update: every block is one version's
            self._store(st)
        return super()._assemble(st, n, sampling)

    def _store(self, st) -> None:
        """The full blocks of each sequence's fed tokens (all but its last), KV and rows cloned."""
        P, T = st.prompt_BP.shape[1], self.prefix.block_tokens
        gen_lens = st.gen_valid_BG[:, : st.num_steps].sum(1).tolist()
        for b, (plen, r) in enumerate(zip(st.prompt_lens_B.tolist(), gen_lens)):
            off = P - plen
            tokens = st.prompt_BP[b, off:].tolist() + st.gen_tokens_BG[b, :r].tolist()
            for i, (key, blk) in enumerate(self.prefix.keys(tokens[: len(tokens) - 1])):
                if key in self.prefix.blocks:
                    self.prefix.blocks.move_to_end(key)
                    continue
                a, z = off + i * T, off + (i + 1) * T
                self.prefix.insert(
                    key,
                    Block(
                        blk,
                        [t[b, :, a:z].clone() for t in st.cache.k],
                        [t[b, :, a:z].clone() for t in st.cache.v],
                        st.routes_BSLK[b, a:z].clone(),
                        st.route_version_BS[b, a:z].clone(),
                    ),
                )
