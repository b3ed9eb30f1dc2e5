"""A tiny deterministic language model in numpy, for the scheduler suite's token-exact check.

Batching must never change what a request generates. To check that of a
scheduler, the suite needs a model whose next token depends on every earlier
token's KV, run two ways:

* :meth:`TinyLM.forward_paged`: one scheduler step, every scheduled token of
  every sequence in one flattened batch; per layer K and V go through the
  slot mapping into a paged cache (``Backend.write_kv``) and attention reads
  them back through the block tables (``Backend.attention``);
* :func:`generate_alone`: one sample of one request by itself, with its K and
  V in contiguous arrays and the spec's causal attention over them
  (:func:`spec.attention.attend`): no pages, no batch, no scheduler.

The weights are seeded float64: token and position embeddings, two
pre-norm layers of grouped-query attention (4 query heads over 2 KV heads)
and a small tanh MLP, each with a residual, and a fixed output projection.
A wrong slot, a missing copy, a swap that restores the wrong block or a token
fed twice changes the KV some later token attends to, and so, almost always,
what it generates.

Sampling is greedy at temperature 0; otherwise Gumbel-max with a generator
seeded by ``(request seed, request id, sample, position)``, so that what a
sample draws cannot depend on who shares its batch, on chunking or on preemption.

>>> from spec.request import Request
>>> r = Request(request_id=0, prompt=(3, 1, 4, 1, 5), max_new_tokens=4)
>>> generate_alone(r, 0)
(38, 56, 52, 62)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from spec.attention import attend
from spec.backend import Backend, KVGeometry
from spec.batch import BatchMetadata
from spec.request import Request

F64 = NDArray[np.float64]

VOCAB_SIZE = 64
"""Token ids the model reads and writes: ``0 .. 63`` (the workloads draw prompts below 61)."""

MAX_POSITIONS = 4096
"""Positions the model has embeddings for (the workloads stay far below)."""


class TinyLM:
    """Seeded float64 weights; ``num_heads`` query heads share ``num_kv_heads`` KV heads."""

    num_layers, num_heads, num_kv_heads, head_dim, d_model = 2, 4, 2, 8, 32

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        d, hd = self.d_model, self.head_dim

        def w(*shape: int, scale: float) -> F64:
            return rng.standard_normal(shape) * scale

        self.embed = w(VOCAB_SIZE, d, scale=1.0)
        self.pos_embed = w(MAX_POSITIONS, d, scale=1.0)
        self.layers = [
            (
                w(d, self.num_heads * hd, scale=1 / math.sqrt(d)),
                w(d, self.num_kv_heads * hd, scale=1 / math.sqrt(d)),
                w(d, self.num_kv_heads * hd, scale=1 / math.sqrt(d)),
                w(self.num_heads * hd, d, scale=2 / math.sqrt(self.num_heads * hd)),
                w(d, 2 * d, scale=1 / math.sqrt(d)),
                w(2 * d, d, scale=1 / math.sqrt(2 * d)),
            )
            for _ in range(self.num_layers)
        ]
        self.unembed = w(d, VOCAB_SIZE, scale=4 / math.sqrt(d))
        self.scale = 1 / math.sqrt(hd)

    def geometry(self, num_blocks: int, block_size: int) -> KVGeometry:
        """The paged cache this model needs over a pool of ``num_blocks`` blocks."""
        return KVGeometry(
            num_layers=self.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    # -- the shared pieces ------------------------------------------------------------

    def _input(self, tokens: Sequence[int], positions: Sequence[int] | NDArray[np.int64]) -> F64:
        """Token embeddings plus learned (seeded) position embeddings."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and not 0 <= pos.min() <= pos.max() < MAX_POSITIONS:
            raise ValueError(f"positions {pos.min()}..{pos.max()} outside 0..{MAX_POSITIONS - 1}")
        x: F64 = self.embed[np.asarray(tokens, dtype=np.int64)] + self.pos_embed[pos]
        return x

    def _qkv(self, layer: int, x: F64) -> tuple[F64, F64, F64]:
        wq, wk, wv = self.layers[layer][:3]
        h = _rms_norm(x)
        q = (h @ wq).reshape(-1, self.num_heads, self.head_dim)
        k = (h @ wk).reshape(-1, self.num_kv_heads, self.head_dim)
        v = (h @ wv).reshape(-1, self.num_kv_heads, self.head_dim)
        return q, k, v

    def _residual(self, layer: int, x: F64, attn: F64) -> F64:
        wo, w1, w2 = self.layers[layer][3:]
        x = x + attn.reshape(x.shape[0], -1) @ wo
        out: F64 = x + np.tanh(_rms_norm(x) @ w1) @ w2
        return out

    def logits(self, hidden: F64) -> F64:
        """``[R, d_model]`` final hidden states to ``[R, VOCAB_SIZE]`` logits."""
        out: F64 = _rms_norm(hidden) @ self.unembed
        return out

    # -- two ways to run it -----------------------------------------------------------

    def forward_paged(
        self, token_ids: Sequence[int], batch: BatchMetadata, backend: Backend
    ) -> F64:
        """Hidden states ``[T, d_model]`` of one step's flattened batch, KV through ``backend``."""
        x = self._input(token_ids, batch.positions)
        for layer in range(self.num_layers):
            q, k, v = self._qkv(layer, x)
            backend.write_kv(layer, k, v, batch.slot_mapping)
            attn = np.asarray(backend.attention(layer, q, batch, self.scale), dtype=np.float64)
            x = self._residual(layer, x, attn)
        return x

    def extend(
        self, cache: list[tuple[F64, F64]], tokens: Sequence[int]
    ) -> tuple[F64, list[tuple[F64, F64]]]:
        """Run ``tokens`` after the contiguous ``cache`` (per layer K, V); new hidden and cache."""
        start = cache[0][0].shape[0] if cache else 0
        positions = np.arange(start, start + len(tokens))
        x = self._input(tokens, positions)
        grown = []
        for layer in range(self.num_layers):
            q, k, v = self._qkv(layer, x)
            if cache:
                k = np.concatenate([cache[layer][0], k])
                v = np.concatenate([cache[layer][1], v])
            grown.append((k, v))
            x = self._residual(layer, x, attend(q, k, v, positions, self.scale))
        return x, grown


def _rms_norm(x: F64) -> F64:
    mean_square = np.einsum("td,td->t", x, x)[:, None] / x.shape[-1]
    out: F64 = x / np.sqrt(mean_square + 1e-6)
    return out


def sample(logits: F64, request: Request, sample_index: int, position: int) -> int:
    """Token ``position`` of sample ``sample_index``: greedy at temperature 0, else seeded.

    >>> r = Request(request_id=3, prompt=(1,), max_new_tokens=1, temperature=1.0, seed=5)
    >>> x = np.zeros(VOCAB_SIZE)
    >>> sample(x, r, 0, 0) == sample(x.copy(), r, 0, 0)   # the same draw, however it was batched
    True
    """
    if request.temperature == 0:
        return int(np.argmax(logits))
    key = [k & (2**63 - 1) for k in (request.seed, request.request_id, sample_index, position)]
    gumbel = np.random.default_rng(key).gumbel(size=logits.shape[-1])
    return int(np.argmax(logits / request.temperature + gumbel))


MODEL = TinyLM()
"""The one model every check uses (its weights are fixed by seed 0)."""


@lru_cache(maxsize=1 << 14)
def generate_alone(request: Request, sample_index: int) -> tuple[int, ...]:
    """Sample ``sample_index`` of ``request`` run by itself, over contiguous attention.

    Memoized: shrinking a failure replays the same requests many times.
    """
    hidden, cache = _prefill(request.prompt)
    out: list[int] = []
    while True:
        token = sample(MODEL.logits(hidden[-1:])[0], request, sample_index, len(out))
        out.append(token)
        if token in request.stop_tokens or len(out) == request.max_new_tokens:
            return tuple(out)
        hidden, cache = MODEL.extend(cache, [token])


@lru_cache(maxsize=1 << 12)
def _prefill(prompt: tuple[int, ...]) -> tuple[F64, list[tuple[F64, F64]]]:
    return MODEL.extend([], prompt)
