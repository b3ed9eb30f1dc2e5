"""A device-resident backend, as an outside project would write one: torch tensors in and out.

It declares ``tensors="torch"``, so the conformance suite hands it tensors on
its device (queries and new K and V of the activation dtype, int64 slots) and
the step's metadata already on the device (``arrays=``), and reads back only
the blocks it compares through ``read_blocks``. Its attention is an *extend*
kernel's: each sequence's cached context is gathered from the paged cache
through the device block table, and its new tokens come straight from the
``key=``/``value=`` the suite passes, never read back from the cache. It
imports only ``spec`` and torch.

>>> backend = make_backend()
>>> backend.capabilities.tensors
'torch'

``--backend tests/device_backend/device_backend.py:make_backend`` conforms;
``:make_buggy_backend`` lets each query see one token past itself (a causal
mask off by one), which the suite catches on the first multi-token prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class DeviceBackend:
    """Paged K and V as one tensor each per layer, ``[num_blocks, block_size, H_kv, D]``."""

    def __init__(self, device: str = "cpu", *, mask_slip: int = 0) -> None:
        self.device = torch.device(device)
        self.mask_slip = mask_slip  # 0: causal; 1: each query also sees the next token (a bug)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name="device-example", device=str(self.device), tensors="torch")

    def create_cache(self, geometry: KVGeometry) -> None:
        g = geometry
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        dtype = DTYPES[g.dtype]
        # uninitialised, as an engine allocates it: untouched pages of a pool past 2^31
        # elements (the suite's large-pool pass) then cost no memory
        self.k = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(g.num_layers)]
        self.v = [torch.empty_like(k) for k in self.k]

    def write_kv(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        n, keep = slot_mapping.shape[0], slot_mapping >= 0  # -1: padding, write nothing
        width = self.k[layer].shape[2:]
        self.k[layer].view(-1, *width)[slot_mapping[keep]] = key[:n][keep]
        self.v[layer].view(-1, *width)[slot_mapping[keep]] = value[:n][keep]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in (*self.k, *self.v):
            cache[dst] = cache[src]

    def attention(
        self,
        layer: int,
        query: torch.Tensor,
        batch: BatchMetadata,
        scale: float,
        *,
        arrays: BatchArrays[torch.Tensor],
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        for i in range(batch.num_seqs):
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            context = batch.seq_lens[i] - (end - start)  # cached tokens before the new ones
            k_old, v_old = self._context(layer, arrays.block_tables[i], context)
            k = torch.cat([k_old, key[start:end]])
            v = torch.cat([v_old, value[start:end]])
            out[start:end] = self._attend(query[start:end], k, v, context, scale)
        return out

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(list(blocks), dtype=torch.int64, device=self.device)
        return self.k[layer][index], self.v[layer][index]  # indexing copies: not views

    def read_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer].clone(), self.v[layer].clone()

    def _context(
        self, layer: int, table: torch.Tensor, context: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``context`` keys and values of a sequence, through its block table row."""
        block_size = self.k[layer].shape[1]
        pos = torch.arange(context, device=self.device)
        slots = table.long()[pos // block_size] * block_size + pos % block_size
        width = self.k[layer].shape[2:]
        return self.k[layer].view(-1, *width)[slots], self.v[layer].view(-1, *width)[slots]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, scale: float
    ) -> torch.Tensor:
        """Causal attention in float32: new token ``j`` sits at position ``context + j``."""
        group = q.shape[1] // k.shape[1]  # query heads per KV head
        kf = k.float().repeat_interleave(group, dim=1)
        vf = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,thd->hnt", q.float(), kf) * scale
        positions = context + torch.arange(q.shape[0], device=self.device)[:, None]
        keys = torch.arange(k.shape[0], device=self.device)[None, :]
        scores = scores.masked_fill((keys > positions + self.mask_slip)[None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return torch.einsum("hnt,thd->nhd", weights, vf).to(q.dtype)


def make_backend() -> DeviceBackend:
    """The factory: ``--backend tests/device_backend/device_backend.py:make_backend``."""
    return DeviceBackend()


def make_buggy_backend() -> DeviceBackend:
    """A planted bug: a causal mask off by one (each query also sees the token after it)."""
    return DeviceBackend(mask_slip=1)
