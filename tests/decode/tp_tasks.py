"""Rank tasks the TP decode tests send to every rank (importable by the spawned ranks)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from lanekv.decode.tp.rank import RankState


class PlaceHeads(NamedTuple):
    """Copy this rank's KV heads of whole-model pool pages (a saved tensor) into its pool."""

    path: str  # torch.save of a whole-model pool tensor [L, 2, rows, Hkv, D]
    pages: tuple[int, ...]  # the same page ids in both pools

    def run(self, state: RankState) -> int:
        full = torch.load(self.path, mmap=True)
        heads = state.pool.tensor.shape[3]
        first = 0 if heads == full.shape[3] else state.tp.rank * heads  # MLA: whole latent rows
        size = state.pool.page_size
        for page in self.pages:
            rows = slice(page * size, (page + 1) * size)
            state.pool.tensor[:, :, rows] = full[:, :, rows, first:first + heads]
        return heads


class Die(NamedTuple):
    """The rank other than 0 exits at once, as a killed one would."""

    def run(self, state: RankState) -> None:
        import os
        if state.tp.rank != 0:
            os._exit(9)


class IndexerTopK(NamedTuple):
    """A DSA layer's indexer top-k for ``tokens`` seeded hidden rows at positions
    ``0..tokens-1``, on the rank's shard (``select`` on any model)."""

    layer: int
    tokens: int
    seed: int

    def select(self, model) -> torch.Tensor:
        config = model.config
        gen = torch.Generator().manual_seed(self.seed)
        hidden = torch.randn(self.tokens, config.hidden_size, generator=gen)
        attn = model.mla_layer(self.layer)
        positions = torch.arange(self.tokens)
        cos, sin = model.rotary(positions)
        proj = attn.project(hidden, cos, sin)
        index = attn.indexer.project(hidden, proj.q_lora, cos, sin)
        return attn.indexer.select(index.q, index.weights, index.k, positions)

    def run(self, state: RankState) -> torch.Tensor:
        with torch.inference_mode():
            return self.select(state.loaded.model)
