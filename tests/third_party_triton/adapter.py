"""``their_kernels`` wired to the contract: what a kernel author writes for the suite.

The kernels keep their own names and argument order; this file only converts:
numpy arrays in, torch tensors of the cache dtype on the device, the step's
metadata as the int32 tensors the kernels take (``batch.arrays()``), and back.
It declares what the kernels can run and no more: decode only
(``max_query_len=1``), power-of-two page sizes, head dims up to 256 with
``head_dim < 16`` only in float32 (the ``excludes`` hook: an fp16 or bf16
``tl.dot`` needs an inner dimension of 16 on a GPU), and bfloat16 only on a
GPU (the interpreter's bfloat16 arithmetic is wrong). The kernels have no
block copy, so copy-on-write is a torch index copy here.

>>> make_backend().capabilities.max_query_len
1
"""

from __future__ import annotations

# --8<-- [start:adapter]
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from spec.attention import AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry

sys.path.insert(0, str(Path(__file__).parent))  # stands in for `pip install` of theirs
from their_kernels import MAX_HEAD_DIM, paged_decode, store_kv

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton was imported


def _small_head_dim_needs_fp32(
    g: KVGeometry, num_heads: int, variant: AttentionVariant | None
) -> str | None:
    """The veto: an fp16/bf16 ``tl.dot`` needs K >= 16 on a GPU (fp32 compiles)."""
    if g.head_dim < 16 and g.dtype != "float32":
        return f"head dim {g.head_dim} in {g.dtype} (tl.dot needs K >= 16 on a GPU)"
    return None


class TheirKernelsBackend:
    """One K and one V cache per layer in the kernels' layout, run through their API.

    ``fast_fp32``: their float32 path at ``tl.dot``'s default precision (TF32 products);
    ``declare_tf32``: say so in the capabilities (``products="tf32"``).
    """

    def __init__(
        self,
        fast_fp32: bool = False,
        declare_tf32: bool = False,
        launch: dict[str, Any] | None = None,
    ) -> None:
        self.fast_fp32, self.declare_tf32 = fast_fp32, declare_tf32
        self.launch = dict(launch or {})  # Triton launch options for every kernel
        if not INTERPRETED and not torch.cuda.is_available():
            raise RuntimeError(
                "no CUDA device: to run the kernels on CPU, set TRITON_INTERPRET=1 "
                "before anything imports triton"
            )
        self.device = torch.device("cpu" if INTERPRETED else "cuda")
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.dtype = torch.float32

    @property
    def capabilities(self) -> Capabilities:
        dtypes = {"float32", "float16"} | (set() if INTERPRETED else {"bfloat16"})
        return Capabilities(
            name="their-kernels",
            device=self.device.type,
            dtypes=frozenset(dtypes),
            block_sizes=frozenset(2**i for i in range(9)),  # 1 .. 256
            head_dims=frozenset(range(1, MAX_HEAD_DIM + 1)),
            max_query_len=1,  # decode only: the suite never hands it a prefill
            excludes=_small_head_dim_needs_fp32,
            products="tf32" if self.declare_tf32 else "exact",
        )

    def create_cache(self, geometry: KVGeometry) -> None:
        g = geometry
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        self.dtype = TORCH[g.dtype]
        self.k = [self._zeros(shape) for _ in range(g.num_layers)]
        self.v = [self._zeros(shape) for _ in range(g.num_layers)]

    def write_kv(
        self,
        layer: int,
        key: FloatArray,
        value: FloatArray,
        slot_mapping: Sequence[int],
    ) -> None:
        n = len(slot_mapping)  # rows past n are padding
        slots = torch.tensor(list(slot_mapping), dtype=torch.int32, device=self.device)
        k, v = self._tensor(key[:n]), self._tensor(value[:n])
        store_kv(k, v, self.k[layer], self.v[layer], slots, **self.launch)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if copies:  # no copy kernel in their_kernels: a torch index copy
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            for cache in (*self.k, *self.v):
                cache[dst] = cache[src]

    def attention(
        self, layer: int, query: FloatArray, batch: BatchMetadata, scale: float
    ) -> FloatArray:
        batch.validate(num_blocks=self.k[layer].shape[0])
        arrays = batch.arrays().map(lambda a: torch.tensor(a, device=self.device))
        q = self._tensor(query[: batch.num_tokens])
        out = torch.empty_like(q)
        k, v = self.k[layer], self.v[layer]
        tables, lens = arrays.block_tables, arrays.seq_lens
        paged_decode(
            out, q, k, v, tables, lens, scale, fast_fp32=self.fast_fp32, **self.launch
        )
        return self._numpy(out)

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        return self._numpy(self.k[layer]), self._numpy(self.v[layer])

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _tensor(self, x: FloatArray) -> torch.Tensor:
        host = torch.from_numpy(
            np.array(x, dtype=np.float32)
        )  # a copy: inputs are read-only
        return host.to(self.device, self.dtype).contiguous()

    def _numpy(self, t: torch.Tensor) -> FloatArray:
        # a copy the caller owns: on CPU, .float().numpy() of float32 is a live view
        out: FloatArray = t.to("cpu", torch.float32, copy=True).numpy()
        return out


def make_backend() -> TheirKernelsBackend:
    """The factory: ``--backend tests/third_party_triton/adapter.py:make_backend``."""
    return TheirKernelsBackend()


def make_fast_fp32_backend() -> TheirKernelsBackend:
    """Their TF32 float32 path, undeclared: the suite fails it, naming TF32."""
    return TheirKernelsBackend(fast_fp32=True)


def make_declared_fast_fp32_backend() -> TheirKernelsBackend:
    """Their TF32 float32 path, declared (``products="tf32"``): it passes."""
    return TheirKernelsBackend(fast_fp32=True, declare_tf32=True)


# --8<-- [end:adapter]
