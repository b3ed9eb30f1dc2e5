"""The data of a workload: its geometry, and every tensor, derived from seeds.

No tensor is drawn element by element. A token's K and V depend only on the
workload seed, the layer, and the token ids of its sequence *up to and
including that token* (a chained digest), never on where it is stored. So a
prefix-cache hit must find exactly the K and V that were written for the same
prefix, and a hit that returns evicted or foreign content shows up as a
difference. Queries depend on the seed, the step and the layer.

Every value is rounded to the cache dtype before either side sees it, so that
KV written by the backend and by the spec can be compared exactly.

>>> config = WorkloadConfig(KVGeometry(1, 4, 2, 1, 8, "float16"), num_heads=2, scale=0.5, seed=7)
>>> truth = TokenKV(config)
>>> k1, _ = truth.rows([5, 9], layer=0)
>>> k2, _ = truth.rows([5, 9, 3], layer=0)
>>> bool((k1 == k2[:2]).all())                 # the same prefix gives the same K
True
>>> k3, _ = truth.rows([6, 9], layer=0)
>>> bool((k3[1] == k1[1]).any())                # token 9 after another prefix: other K
False

A latent geometry (multi-head latent attention) has one KV head whose two
parts are c_kv and k_rope (:attr:`~spec.kv_geometry.KVGeometry.kv_widths`):
every row the workload makes, written or read, has those widths, and its
parts are named so in a difference.

>>> mla = WorkloadConfig(latent_geometry(4, 32, 16, "float16", 1), 2, 0.2, seed=7)
>>> [x.shape for x in TokenKV(mla).rows([5, 9], layer=0)], kv_parts(mla.geometry)
([(2, 1, 32), (2, 1, 16)], ('c_kv', 'k_rope'))
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from conformance.judges.dtypes import F64, round_to
from spec.attention import PLAIN, AttentionVariant
from spec.kv_geometry import KVGeometry
from spec.kv_groups import FULL_ATTENTION, KVCacheGroup, sliding_window

POOL_BLOCKS = {1: 40, 3: 16, 4: 14, 16: 6}
"""Pool size per block size: small, so that allocations fail and blocks are reused.

Other block sizes get about 96 tokens, and at least 5 blocks (room for a
prompt of ``2B + 1`` tokens and some growth)."""
LONG_CONTEXT_SLOTS = 2048
"""Pool size, in tokens, of a long-context workload: room for one longest prompt and more."""
LONG_PROMPTS = (300, 1100)
"""Shortest and longest long prompt: past the 64-key tiles and the 256/512/1024 switch points."""
LARGE_LOGIT_GAIN = 16.0
"""A scale of ``16 / sqrt(D)`` gives scores of spread about 16: exp overflows fp16 past 11."""
PAD_VALUE = 1000.0
"""Magnitude of padding rows (rows whose slot is -1): visible if anyone stores them."""

INT32_ELEMENTS = 2**31
"""Element offsets at or past this overflow a signed 32-bit integer."""

SCALE_MANTISSA = 0.875
"""Drawn fp8 scales are this times a power of two: 7 is the odd factor whose float32 reciprocal
errs enough that multiplying by it rounds fp8 ties the other way (in both formats), as a
compiled ``div.full.f32`` may: the spec accepts either side of a tie
(:func:`spec.quant.quantize_range`), and the report counts how often a backend took the other."""
TIES = {"fp8_e4m3": (1.8125, 1.5625), "fp8_e5m2": (1.625,)}
"""Quotients that are fp8 rounding ties below an even neighbour: ``x / s`` rounds them down (to
even), ``x * (1 / s)`` in float32 lands just above them and rounds up (``s`` 7/8 of a power of
two); both are correct stored values."""


def tie_values(kv_dtype: str, scale: float) -> tuple[float, ...]:
    """Values ``x`` exact in every activation dtype whose quotient ``x / scale`` is an fp8
    rounding tie (see :data:`TIES`), at three magnitudes.

    >>> from spec.quant import quantize
    >>> x = tie_values("fp8_e4m3", 7 / 2**11)
    >>> quantize(np.array(x[:1]), 7 / 2**11, "fp8_e4m3").tolist()    # 1.8125: to even, 1.75
    [1.75]
    """
    return tuple(m * 2**e * scale for m in TIES[kv_dtype] for e in range(3))


POISONS = {"NaN": math.nan, "+inf": math.inf, "-inf": -math.inf, "finite": 1000.0}
"""What a poisoned example fills every slot no live token owns with (see
:meth:`~conformance.lockstep.poison.Poison.unowned`): a kernel that reads such a
slot, even to multiply it by a zero weight, gets a non-finite output; with ``"finite"``
(``--poison finite``) only a kernel that uses what it reads there goes wrong."""
NON_FINITE = ("NaN", "+inf", "-inf")


def poison_rows(config: WorkloadConfig, count: int) -> tuple[F64, F64]:
    """``count`` rows of K and of V (c_kv and k_rope) of the example's poison value."""
    assert config.poison is not None
    k, v = _row_shapes(config.geometry, count)
    return np.full(k, POISONS[config.poison]), np.full(v, POISONS[config.poison])


KV_PARTS = ("K", "V")
LATENT_PARTS = ("c_kv", "k_rope")
"""What the two parts of a write and a read are called: K and V, or a latent row's c_kv and
k_rope (the names a difference reports)."""


def kv_parts(geometry: KVGeometry) -> tuple[str, str]:
    """The names of ``geometry``'s two KV parts: :data:`KV_PARTS` or :data:`LATENT_PARTS`."""
    return LATENT_PARTS if geometry.is_latent else KV_PARTS


def _row_shapes(geometry: KVGeometry, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of ``count`` rows of K and V: ``[count, H_kv, width]`` each (latent: c_kv and
    k_rope, :attr:`~spec.kv_geometry.KVGeometry.kv_widths`)."""
    k, v = geometry.kv_widths
    return (count, geometry.num_kv_heads, k), (count, geometry.num_kv_heads, v)


def _both(geometry: KVGeometry, raw: F64) -> tuple[F64, F64]:
    """``raw`` ``[..., H_kv, head_dim + value width]`` split into K and V of their widths
    (one draw serves both, so a latent row's parts come from one stream)."""
    k = geometry.kv_widths[0]
    return raw[..., :k], raw[..., k:]


_Q, _BACKGROUND, _PAD, _GUARD = 1, 2, 3, 4  # stream tags: no two uses share a random stream


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything fixed for one workload: geometry, query heads, scale, seed, and the options."""

    geometry: KVGeometry
    num_heads: int
    scale: float
    seed: int
    prefix_caching: bool = False
    long_context: bool = False  # a large pool, and long prompts prefilled in large chunks
    variants: tuple[AttentionVariant, ...] = ()  # per layer; () means plain attention everywhere
    block_base: int = 0  # the backend sees spec block b as block_base + b (a large pool)
    group_windows: tuple[int | None, ...] = ()  # per KV cache group: None full, w a window
    poison: str | None = None  # what slots no live token owns hold: None (finite), or POISONS

    def __post_init__(self) -> None:
        if self.num_heads % self.geometry.num_kv_heads:
            raise ValueError(
                f"{self.num_heads} query heads do not divide into "
                f"{self.geometry.num_kv_heads} KV heads"
            )
        if self.variants and len(self.variants) != self.geometry.num_layers:
            raise ValueError(
                f"{len(self.variants)} attention variants for {self.geometry.num_layers} layers"
            )
        for v in self.variants:
            v.check_heads(self.num_heads)
        if self.block_base < 0:
            raise ValueError(f"block_base must be >= 0, got {self.block_base}")
        if self.group_windows:
            self._check_group_windows()
        if self.poison is not None and self.poison not in POISONS:
            raise ValueError(f"poison must be one of {list(POISONS)} or None, got {self.poison!r}")

    def variant(self, layer: int) -> AttentionVariant:
        """The attention variant of ``layer`` (plain unless the workload draws one)."""
        return self.variants[layer] if self.variants else PLAIN

    @property
    def dtype(self) -> str:
        return self.geometry.dtype

    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The spec's groups, in batch-group order; empty for one full-attention group."""
        return tuple(FULL_ATTENTION if w is None else sliding_window(w) for w in self.group_windows)

    def _check_group_windows(self) -> None:
        """One window (or ``None``) per group of the geometry; a windowed group's layers see no
        further back than its window, since the blocks before it are released."""
        g = self.geometry
        if len(self.group_windows) != g.num_groups:
            raise ValueError(
                f"{len(self.group_windows)} group windows for {g.num_groups} KV cache groups"
            )
        for layer in range(g.num_layers):
            w = self.group_windows[g.group_of(layer)]
            seen = self.variant(layer).window
            if w is not None and (seen is None or seen > w):
                raise ValueError(
                    f"layer {layer} is in a KV cache group with a window of {w} tokens, but its "
                    f"attention window is {seen}: it would read blocks the group released"
                )


def geometry_for(
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: str,
    layers: int,
    long_context: bool = False,
) -> tuple[KVGeometry, int]:
    """The KV geometry and number of query heads for one drawn shape.

    >>> geometry_for(16, 1, 1, 8, "float16", 1, long_context=True)[0].num_blocks
    128
    """
    blocks = -(-LONG_CONTEXT_SLOTS // block_size) if long_context else pool_blocks(block_size)
    geometry = KVGeometry(layers, blocks, block_size, num_kv_heads, head_dim, dtype)
    return geometry, num_kv_heads * group


def latent_geometry(
    block_size: int, latent_dim: int, rope_dim: int, dtype: str, layers: int
) -> KVGeometry:
    """A latent geometry (one KV head, rows of ``latent_dim + rope_dim``) of a short pool.

    >>> g = latent_geometry(16, 512, 64, "bfloat16", 1)
    >>> g.head_dim, g.num_kv_heads, g.kv_widths
    (576, 1, (512, 64))
    """
    blocks = pool_blocks(block_size)
    head_dim = latent_dim + rope_dim
    return KVGeometry(layers, blocks, block_size, 1, head_dim, dtype, latent_dim=latent_dim)


def pool_blocks(block_size: int, tokens: int = 96) -> int:
    """Blocks of a short workload's pool: :data:`POOL_BLOCKS`, else about ``tokens`` (5 at least).

    >>> [pool_blocks(b) for b in (4, 8, 48, 64)]
    [14, 12, 5, 5]
    """
    return POOL_BLOCKS.get(block_size, max(5, -(-tokens // block_size)))


def large_pool_base(geometry: KVGeometry) -> int:
    """The first backend block of a large pool: spec block 1 starts past 2^31 elements.

    Spec block 0 is the last block that starts below 2^31 (or at it), so the
    first sequence's first block sits at the boundary and everything after it
    beyond; a guard block below it and one above the spec's pool are never
    written by the workload.

    >>> g = KVGeometry(1, 14, 16, 1, 8)                  # 128 elements per block
    >>> base = large_pool_base(g)
    >>> (base * 128 < 2**31 <= (base + 1) * 128, base)
    (True, 16777215)
    """
    per_block = geometry.block_size * geometry.num_kv_heads * geometry.head_dim
    return -(-INT32_ELEMENTS // per_block) - 1


def scale_for(head_dim: int, large_logits: bool) -> float:
    """The softmax scale: the usual ``1 / sqrt(D)``, or one that makes logits large."""
    return (LARGE_LOGIT_GAIN if large_logits else 1.0) / math.sqrt(head_dim)


def latent_scale(nope_dim: int, rope_dim: int, large_logits: bool) -> float:
    """A latent model's softmax scale: ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, as
    DeepSeek's (``nope_dim`` is the model's, drawn: :func:`nope_dims`), times the large-logit
    gain when asked. Never the row width's: a kernel that derives it from the cache shows.

    >>> latent_scale(128, 64, False) == 1 / math.sqrt(192)
    True
    """
    return scale_for(nope_dim + rope_dim, large_logits)


def nope_dims(latent_dim: int, rope_dim: int) -> tuple[int, ...]:
    """The model's per-head non-rotary query and key width (``qk_nope_head_dim``) a latent
    workload draws its scale from: twice the rope width (DeepSeek-V3's 128 beside 64), half
    of it, three times it, but never the one that makes ``nope + rope`` the row's width
    (``1 / sqrt(latent_dim + rope_dim)`` is the mistake the suite must tell apart).

    >>> nope_dims(512, 64), nope_dims(32, 16)
    ((128, 32, 192), (8, 48))
    """
    out = (2 * rope_dim, max(1, rope_dim // 2), 3 * rope_dim)
    return tuple(n for n in out if n != latent_dim)


def large_logits(config: WorkloadConfig) -> bool:
    """Whether ``config`` uses the large-logit scale (rather than about ``1 / sqrt(D)``)."""
    return large_scale(config.scale, config.geometry.head_dim)


def large_scale(scale: float, head_dim: int) -> bool:
    """Whether ``scale`` is a large-logit one for rows ``head_dim`` wide: nearer
    ``LARGE_LOGIT_GAIN / sqrt(head_dim)`` than ``1 / sqrt(head_dim)`` (a latent model's scale,
    :func:`latent_scale`, is neither exactly, and is told apart all the same).

    >>> large_scale(latent_scale(8, 16, True), 48), large_scale(latent_scale(48, 16, False), 48)
    (True, False)
    """
    return abs(scale * math.sqrt(head_dim)) > 0.5 * (1.0 + LARGE_LOGIT_GAIN)


def _seeded(*words: int) -> np.random.Generator:
    return np.random.default_rng([w & 0xFFFF_FFFF_FFFF_FFFF for w in words])


class TokenKV:
    """The ground-truth K and V of every token, memoized by (prefix digest, layer)."""

    def __init__(self, config: WorkloadConfig) -> None:
        self._config = config
        self._memo: dict[tuple[bytes, int], tuple[F64, F64]] = {}

    def rows(self, tokens: Sequence[int], layer: int, start: int = 0) -> tuple[F64, F64]:
        """K and V ``[len(tokens) - start, H_kv, D]`` of positions ``start ..`` of ``tokens``
        (latent: c_kv and k_rope, of their widths)."""
        k_shape, v_shape = _row_shapes(self._config.geometry, len(tokens) - start)
        k, v = np.empty(k_shape), np.empty(v_shape)
        for p, digest in enumerate(prefix_digests(tokens)[start:]):
            k[p], v[p] = self._row(digest, layer)
        return k, v

    def _row(self, digest: bytes, layer: int) -> tuple[F64, F64]:
        key = (digest, layer)
        if key not in self._memo:
            g = self._config.geometry
            word = int.from_bytes(digest[:8], "little")
            if g.is_latent:  # one row [c_kv, k_rope]: one draw, split
                raw = _seeded(self._config.seed, layer, word).standard_normal((1, g.head_dim))
                both = _both(g, round_to(raw, g.dtype))
            else:
                raw = _seeded(self._config.seed, layer, word).standard_normal(
                    (2, g.num_kv_heads, g.head_dim)
                )
                rounded = round_to(raw, g.dtype)
                both = (rounded[0], rounded[1])
            if g.kv_dtype is not None:
                _place_ties(both, g.kv_dtype, g.kv_scales[layer], word)
            self._memo[key] = both
        return self._memo[key]


def _place_ties(
    both: tuple[F64, F64], kv_dtype: str, scales: tuple[float, float], word: int
) -> None:
    """Put one value of :func:`tie_values` (of the K or V scale) into each head of a token's K and
    V, at an element and sign chosen by ``word``: every token then has a quotient where a
    compiled division may land on either side (both accepted), and where a quantizer that
    rounds wrong in other ways (toward zero) shows."""
    for which, part in enumerate(both):
        heads, dim = part.shape
        ties = tie_values(kv_dtype, scales[which])
        for h in range(heads):
            bits = word >> (8 * (2 * h + which) % 56)
            sign = -1.0 if bits & 1 else 1.0
            part[h, (bits >> 1) % dim] = sign * ties[(bits >> 4) % len(ties)]


class SequenceTruth:
    """Each live sequence's true K and V per layer, kept and extended as the sequence grows.

    Digests are computed once per token, not once per token per step, and a
    fork starts from its parent's rows. A sequence whose tokens are not an
    extension of what is kept is recomputed, so a stale entry can never be used.

    >>> config = WorkloadConfig(KVGeometry(1, 4, 2, 1, 8), num_heads=1, scale=0.5, seed=7)
    >>> truth = SequenceTruth(TokenKV(config))
    >>> k, _ = truth.rows(0, (5, 9, 3), layer=0)
    >>> bool((k == TokenKV(config).rows([5, 9, 3], 0)[0]).all())
    True
    """

    def __init__(self, token_kv: TokenKV) -> None:
        self._token_kv = token_kv
        self._kept: dict[tuple[int, int], tuple[tuple[int, ...], F64, F64]] = {}

    def rows(self, seq_id: int, tokens: Sequence[int], layer: int) -> tuple[F64, F64]:
        """K and V ``[len(tokens), H_kv, D]`` of sequence ``seq_id``, of token ids ``tokens``."""
        tokens = tuple(tokens)
        kept = self._kept.get((seq_id, layer))
        if kept is None or tokens[: len(kept[0])] != kept[0]:
            k, v = self._token_kv.rows(tokens, layer)
        elif len(kept[0]) == len(tokens):
            return kept[1], kept[2]
        else:
            k_new, v_new = self._token_kv.rows(tokens, layer, start=len(kept[0]))
            k, v = np.concatenate([kept[1], k_new]), np.concatenate([kept[2], v_new])
        self._kept[(seq_id, layer)] = (tokens, k, v)
        return k, v

    def fork(self, parent: int, child: int) -> None:
        for (seq, layer), entry in list(self._kept.items()):
            if seq == parent:
                self._kept[(child, layer)] = entry

    def drop(self, seq_id: int) -> None:
        for key in [key for key in self._kept if key[0] == seq_id]:
            del self._kept[key]


def prefix_digests(tokens: Sequence[int]) -> list[bytes]:
    """Digest ``p`` names ``tokens[: p + 1]``: a chain, so equal digests mean equal prefixes."""
    digests, parent = [], b""
    for token in tokens:
        parent = hashlib.blake2b(parent + int(token).to_bytes(8, "little", signed=True)).digest()
        digests.append(parent)
    return digests


def queries(config: WorkloadConfig, step: int, layer: int, num_tokens: int) -> F64:
    """The query ``[num_tokens, H, D]`` of one step and layer (latent: each head ``[q_latent,
    q_rope]``, as wide as the row)."""
    raw = _seeded(config.seed, _Q, step, layer).standard_normal(
        (num_tokens, config.num_heads, config.geometry.head_dim)
    )
    return round_to(raw, config.dtype)


def background(config: WorkloadConfig, layer: int) -> tuple[F64, F64]:
    """K and V for every slot before the workload starts, so that any stray write shows."""
    g = config.geometry
    return _normal_rows(g, _seeded(config.seed, _BACKGROUND, layer), g.num_blocks * g.block_size)


def guard_background(config: WorkloadConfig, layer: int, num_slots: int) -> tuple[F64, F64]:
    """K and V of the guard blocks around a large pool's workload: never written after priming."""
    return _normal_rows(config.geometry, _seeded(config.seed, _GUARD, layer), num_slots)


def _normal_rows(g: KVGeometry, rng: np.random.Generator, count: int) -> tuple[F64, F64]:
    """``count`` rows of K and V of unit normals in the dtype (latent: one draw, split)."""
    if g.is_latent:
        return _both(g, round_to(rng.standard_normal((count, 1, g.head_dim)), g.dtype))
    both = round_to(rng.standard_normal((2, count, g.num_kv_heads, g.head_dim)), g.dtype)
    return both[0], both[1]


def padding_rows(config: WorkloadConfig, step: int, layer: int, count: int) -> tuple[F64, F64]:
    """Rows of K and V that sit under slot ``-1`` or past the slot mapping: a backend must
    store none (V's are negative; latent: c_kv's and k_rope's)."""
    g = config.geometry
    raw = _seeded(config.seed, _PAD, step, layer).uniform(
        0.5 * PAD_VALUE, PAD_VALUE, (count, g.num_kv_heads, g.head_dim)
    )
    out: NDArray[np.float64] = round_to(raw, g.dtype)
    if g.is_latent:
        k, v = _both(g, out)
        return k, -v
    return out, -out
