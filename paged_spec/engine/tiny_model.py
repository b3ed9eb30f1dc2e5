"""A tiny deterministic decoder-only language model in numpy, and its unbatched reference run.

Batching must never change what a request generates. To check that of an
engine (or of a scheduler driving one), we need a model whose next token
depends on every earlier token's KV, run two ways:

* :meth:`TinyModel.forward_paged`: one scheduler step, every scheduled token
  of every sequence in one flattened batch; per layer K and V go through the
  slot mapping into a paged cache (``Backend.write_kv``) and attention reads
  them back through the block tables (``Backend.attention``);
* :meth:`TinyModel.extend`: one sequence by itself, its K and V in contiguous
  arrays and the spec's causal attention over them
  (:func:`spec.attention.attend`): no pages, no batch, no scheduler.

The weights are seeded float64 (``numpy.random.default_rng(config.seed)``):
token and learned position embeddings, pre-norm layers of grouped-query
attention and a small tanh MLP, each with a residual, and a fixed output
projection. A wrong slot, a missing copy, a swap that restores the wrong
block or a token fed twice changes the KV some later token attends to, and
so, almost always, what it generates.

:func:`generate_alone` runs one sample of a request by itself with the
second way; an engine must reproduce it token for token with the first.
Sampling is greedy at temperature 0; otherwise Gumbel-max (argmax of
``logits / T`` plus Gumbel noise, which is exact sampling from the softmax)
with a generator seeded by ``(request seed, request id, sample, position)``,
so that what a sample draws cannot depend on who shares its batch, on
chunking or on preemption.

>>> from spec.request import Request
>>> r = Request(request_id=0, prompt=(3, 1, 4, 1, 5), max_new_tokens=4)
>>> generate_alone(TinyModel(SMALL), r, 0)
(38, 56, 52, 62)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from spec.attention import attend
from spec.backend import Backend
from spec.batch import BatchMetadata
from spec.kv_geometry import KVGeometry
from spec.request import Request

F64 = NDArray[np.float64]

KVCache = list[tuple[F64, F64]]
"""One sequence's contiguous K and V, per layer: ``[t, num_kv_heads, head_dim]`` each."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the tiny model; ``num_heads`` must be a multiple of ``num_kv_heads``."""

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 128
    max_positions: int = 512
    seed: int = 0


SMALL = ModelConfig(vocab_size=64, d_model=32, head_dim=8, d_ff=64, max_positions=4096)
"""The scheduler suite's model (and the engine tests'): 64 tokens, 4 query heads over 2 KV heads."""


class TinyModel:
    """Seeded float64 weights of ``config``; see the module docstring."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        cfg = config or ModelConfig()
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"num_heads {cfg.num_heads} % num_kv_heads {cfg.num_kv_heads} != 0")
        self.config = cfg
        rng = np.random.default_rng(cfg.seed)

        def w(*shape: int, scale: float) -> F64:
            return rng.standard_normal(shape) * scale

        d, hd, heads, kv_heads = cfg.d_model, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.embed = w(cfg.vocab_size, d, scale=1.0)
        self.pos_embed = w(cfg.max_positions, d, scale=1.0)
        self.layers = [
            (
                w(d, heads * hd, scale=1 / math.sqrt(d)),
                w(d, kv_heads * hd, scale=1 / math.sqrt(d)),
                w(d, kv_heads * hd, scale=1 / math.sqrt(d)),
                w(heads * hd, d, scale=2 / math.sqrt(heads * hd)),
                w(d, cfg.d_ff, scale=1 / math.sqrt(d)),
                w(cfg.d_ff, d, scale=1 / math.sqrt(cfg.d_ff)),
            )
            for _ in range(cfg.num_layers)
        ]
        self.unembed = w(d, cfg.vocab_size, scale=4 / math.sqrt(d))
        self.scale = 1 / math.sqrt(hd)

    def geometry(self, num_blocks: int, block_size: int) -> KVGeometry:
        """The paged cache this model needs over a pool of ``num_blocks`` blocks."""
        cfg = self.config
        return KVGeometry(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

    # -- the shared pieces ------------------------------------------------------------

    def _input(self, tokens: Sequence[int], positions: Sequence[int] | NDArray[np.int64]) -> F64:
        """Token embeddings plus learned (seeded) position embeddings."""
        top = self.config.max_positions
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and not 0 <= pos.min() <= pos.max() < top:
            raise ValueError(f"positions {pos.min()}..{pos.max()} outside 0..{top - 1}")
        x: F64 = self.embed[np.asarray(tokens, dtype=np.int64)] + self.pos_embed[pos]
        return x

    def _qkv(self, layer: int, x: F64) -> tuple[F64, F64, F64]:
        cfg = self.config
        wq, wk, wv = self.layers[layer][:3]
        h = _rms_norm(x)
        q = (h @ wq).reshape(-1, cfg.num_heads, cfg.head_dim)
        k = (h @ wk).reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ wv).reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def _residual(self, layer: int, x: F64, attn: F64) -> F64:
        wo, w1, w2 = self.layers[layer][3:]
        x = x + attn.reshape(x.shape[0], -1) @ wo
        out: F64 = x + np.tanh(_rms_norm(x) @ w1) @ w2
        return out

    def logits(self, hidden: F64) -> F64:
        """``[R, d_model]`` final hidden states to ``[R, vocab_size]`` logits."""
        out: F64 = _rms_norm(hidden) @ self.unembed
        return out

    # -- two ways to run it -----------------------------------------------------------

    def forward_paged(
        self, token_ids: Sequence[int], batch: BatchMetadata, backend: Backend
    ) -> F64:
        """Hidden states ``[T, d_model]`` of one step's flattened batch, KV through ``backend``."""
        x = self._input(token_ids, batch.positions)
        for layer in range(self.config.num_layers):
            q, k, v = self._qkv(layer, x)
            backend.write_kv(layer, k, v, batch.slot_mapping)
            attn = np.asarray(backend.attention(layer, q, batch, self.scale), dtype=np.float64)
            x = self._residual(layer, x, attn)
        return x

    def extend(
        self, cache: KVCache, tokens: Sequence[int], num_layers: int | None = None
    ) -> tuple[F64, KVCache]:
        """Run ``tokens`` after the contiguous ``cache`` (per layer K, V); new hidden and cache.

        ``extend([], tokens)`` runs a whole sequence from its first token;
        ``num_layers`` runs only the first layers (a layer-skip draft model).
        """
        start = cache[0][0].shape[0] if cache else 0
        positions = np.arange(start, start + len(tokens))
        x = self._input(tokens, positions)
        grown = []
        depth = self.config.num_layers if num_layers is None else num_layers
        assert 0 < depth <= self.config.num_layers, f"num_layers {depth} of a model of fewer"
        for layer in range(depth):
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
    >>> x = np.zeros(64)
    >>> sample(x, r, 0, 0) == sample(x.copy(), r, 0, 0)   # the same draw, however it was batched
    True
    """
    if request.temperature == 0:
        return int(np.argmax(logits))
    key = [k & (2**63 - 1) for k in (request.seed, request.request_id, sample_index, position)]
    gumbel = np.random.default_rng(key).gumbel(size=logits.shape[-1])
    return int(np.argmax(logits / request.temperature + gumbel))


@lru_cache(maxsize=1 << 14)
def generate_alone(model: TinyModel, request: Request, sample_index: int = 0) -> tuple[int, ...]:
    """Sample ``sample_index`` of ``request`` run by itself, over contiguous attention.

    Memoized: shrinking a failure replays the same requests many times.
    """
    hidden, cache = _prefill(model, request.prompt)
    out: list[int] = []
    while True:
        token = sample(model.logits(hidden[-1:])[0], request, sample_index, len(out))
        out.append(token)
        if token in request.stop_tokens or len(out) == request.max_new_tokens:
            return tuple(out)
        hidden, cache = model.extend(cache, [token])


@lru_cache(maxsize=1 << 12)
def _prefill(model: TinyModel, prompt: tuple[int, ...]) -> tuple[F64, KVCache]:
    return model.extend([], prompt)
