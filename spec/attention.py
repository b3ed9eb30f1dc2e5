"""Reference paged attention, in float64: what every backend must compute, one sequence at a time.

For each scheduled query token at position ``p`` of its sequence, attention
reads that sequence's keys and values at positions ``0 .. p`` (causal), found
through its block table, never assuming they are contiguous. Query head ``h``
reads KV head ``h // (H / H_kv)``: grouped-query attention, where
``H / H_kv`` query heads share one KV head (multi-query attention when
``H_kv = 1``). Scores are scaled by ``1 / sqrt(head_dim)`` unless told otherwise.

>>> from spec.block_manager import BlockManager
>>> from spec.batch import build_batch
>>> from spec.kv_memory import KVMemory
>>> m = BlockManager(num_blocks=4, block_size=2)
>>> _ = m.add_sequence(0, [1, 2, 3])
>>> slots = m.append_slots(0, [1, 2, 3])
>>> mem = KVMemory(1, 4, 2, num_kv_heads=1, head_dim=1)
>>> kv = np.array([[[0.0]], [[0.0]], [[6.0]]])
>>> mem.write(0, kv, kv, slots)
>>> out = paged_attention(np.zeros((3, 1, 1)), build_batch(m, [(0, 3)]), mem, layer=0)
>>> out[:, 0, 0].tolist()    # uniform weights over 1, 2 and 3 visible keys
[0.0, 0.0, 2.0]

**Variants.** Production models change the scores before the softmax. An
:class:`AttentionVariant` names the changes one layer makes, applied in this
order to the scaled scores ``s = scale * q . k`` of a query at position ``p``
and a key at position ``k``:

1. soft-capping (Gemma 2): ``s = c * tanh(s / c)``, so no logit exceeds ``c``;
2. ALiBi (BLOOM, MPT): ``s += slope_h * (k - p)``, a per-head linear penalty
   on distance (``k - p <= 0`` for every visible key);
3. visibility: causal (``k <= p``), and with a sliding window of ``w`` tokens
   (Mistral, Gemma 2/3, gpt-oss) only the last ``w`` positions:
   ``p - w < k <= p`` (the query itself and ``w - 1`` keys before it, the
   convention that vLLM passes as ``window_size=(w - 1, 0)``);
4. softmax, where a sink (gpt-oss) is one extra logit per query head that
   joins the denominator and contributes no value:
   ``weight_k = exp(s_k - m) / (exp(sink_h - m) + sum_j exp(s_j - m))``,
   with ``m`` the maximum over the scores and the sink.

A window of 2 over values 0, 1, 2, 3 averages the last two; a sink of 0 logit
against scores of 0 takes one share of the weight:

>>> q = np.zeros((1, 1, 1)); k = np.zeros((4, 1, 1)); v = np.arange(4.0).reshape(4, 1, 1)
>>> float(attend(q, k, v, np.array([3]), 1.0, AttentionVariant(window=2))[0, 0, 0])
2.5
>>> round(float(attend(q, k, v, np.array([3]), 1.0, AttentionVariant(sinks=(0.0,)))[0, 0, 0]), 9)
1.2

**Latent attention** (multi-head latent attention, DeepSeek-V2/V3: the latent
layout of :mod:`spec.kv_memory`). The cache holds one row ``[c_kv, k_rope]`` a
token, shared by every query head; query head ``h`` brings ``[q_latent[h],
q_rope[h]]``, as wide as the row. Its score against token ``t`` is ``scale *
(q_latent[h] . c_kv[t] + q_rope[h] . k_rope[t])``, which is ``scale * q[h] .
row[t]``, and its output is the softmax-weighted sum of ``c_kv[t]``
(``latent_dim`` wide): attention with one KV head whose key is the whole row
and whose value is its first ``latent_dim`` columns (:func:`latent_kv`), so
the variants apply unchanged. The scale is the model's (DeepSeek's is
``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``), never the row width's.

This is the *absorbed* form decode kernels compute. It equals ordinary
multi-head attention whose per-head keys and values are up-projected from
``c_kv`` by the model's ``W_UK`` and ``W_UV`` (the *expanded* form prefill
kernels use): ``q_nope[h] . (W_UK[h] c)`` is ``(W_UK[h]^T q_nope[h]) . c``,
and ``W_UV[h]`` commutes with the weighted sum. On a small example:

>>> rng = np.random.default_rng(0)
>>> heads, latent, rope, nope, v_dim, t = 2, 4, 2, 3, 3, 5
>>> c_kv, k_rope = rng.normal(size=(t, 1, latent)), rng.normal(size=(t, 1, rope))
>>> w_uk, w_uv = rng.normal(size=(heads, nope, latent)), rng.normal(size=(heads, v_dim, latent))
>>> q_nope, q_rope = rng.normal(size=(1, heads, nope)), rng.normal(size=(1, heads, rope))
>>> scale, positions = 1 / np.sqrt(nope + rope), np.array([t - 1])  # the model's scale
>>> k_nope = np.einsum("hdl,tl->thd", w_uk, c_kv[:, 0])             # expanded: per-head K, V
>>> k = np.concatenate([k_nope, np.repeat(k_rope, heads, axis=1)], axis=-1)
>>> v = np.einsum("hdl,tl->thd", w_uv, c_kv[:, 0])
>>> expanded = attend(np.concatenate([q_nope, q_rope], axis=-1), k, v, positions, scale)
>>> q_latent = np.einsum("hdl,nhd->nhl", w_uk, q_nope)              # absorbed: W_UK^T q_nope
>>> q = np.concatenate([q_latent, q_rope], axis=-1)                 # [1, heads, latent + rope]
>>> out = attend_latent(q, c_kv, k_rope, positions, scale)          # [1, heads, latent]
>>> out.shape, bool(np.allclose(np.einsum("hdl,nhl->nhd", w_uv, out), expanded))
((1, 2, 4), True)

This module is the definition, written to be read: :func:`attend` is one
sequence's attention, step by step, and :func:`paged_attention` gathers each
sequence's keys through its block table and attends. The conformance suite
and the reference backend compute the same thing faster, many decodes at once
(:mod:`spec.attention_batched`), and at a kernel's lower precision
(:mod:`spec.precision`); tests prove both equal to this definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from spec.batch import BatchMetadata
from spec.errors import ArgumentTypeError, ArgumentValueError, InvalidRequestError
from spec.kv_memory import KVMemory
from spec.validate import check_instance, check_int, check_real, check_scale

F64 = NDArray[np.float64]

VARIANTS = ("window", "softcap", "sinks", "alibi")
"""The attention variants the contract knows, by the name a backend declares them with."""


@dataclass(frozen=True)
class AttentionVariant:
    """What one layer's attention does beyond plain causal softmax (``None``: not used).

    ``window``: sliding window of ``w >= 1`` tokens. ``softcap``: the cap ``c > 0``.
    ``sinks``: one logit per query head. ``alibi_slopes``: one slope per query head.
    """

    window: int | None = None  # a query sees its last ``window`` positions
    softcap: float | None = None  # scores become ``c * tanh(s / c)``, ``c > 0`` (Gemma 2)
    sinks: tuple[float, ...] | None = None  # one extra softmax logit per query head (gpt-oss)
    alibi_slopes: tuple[float, ...] | None = None  # ``s += slope * (k - p)`` per query head

    def __post_init__(self) -> None:
        if self.window is not None:
            check_int("window", self.window, low=1)
        if self.softcap is not None:
            check_scale("softcap", self.softcap)
        for name in ("sinks", "alibi_slopes"):
            values = getattr(self, name)
            if values is not None:
                if not isinstance(values, tuple) or not values:
                    raise ArgumentValueError(f"{name} must be a non-empty tuple, got {values!r}")
                for i, x in enumerate(values):
                    check_real(f"{name}[{i}]", x)

    @property
    def features(self) -> frozenset[str]:
        """The names (of :data:`VARIANTS`) this variant uses."""
        used = (self.window, self.softcap, self.sinks, self.alibi_slopes)
        return frozenset(name for name, x in zip(VARIANTS, used, strict=True) if x is not None)

    @property
    def is_plain(self) -> bool:
        return not self.features

    def check_heads(self, num_heads: int) -> None:
        """Sinks and ALiBi slopes come one per query head."""
        for name in ("sinks", "alibi_slopes"):
            values = getattr(self, name)
            if values is not None and len(values) != num_heads:
                raise ArgumentValueError(
                    f"{name} has {len(values)} entries, but there are {num_heads} query heads"
                )

    def first_visible(self, position: int) -> int:
        """The earliest key position a query at ``position`` sees."""
        return 0 if self.window is None else max(0, position - self.window + 1)


PLAIN = AttentionVariant()
"""Plain causal softmax attention."""


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """The standard ALiBi slopes: ``2 ** (-8 i / n)`` for ``i = 1 .. n`` when ``n`` is a power of 2.

    Otherwise the slopes of the largest power of two ``n0 < n``, then every
    other slope of ``2 * n0`` heads for the rest (the ALiBi paper's rule).

    >>> alibi_slopes(4)
    (0.25, 0.0625, 0.015625, 0.00390625)
    >>> len(alibi_slopes(12)), alibi_slopes(12)[8]
    (12, 0.7071067811865476)
    """
    n = check_int("num_heads", num_heads, low=1)
    n0 = 1 << (n.bit_length() - 1)
    first = [2.0 ** (-8.0 * i / n0) for i in range(1, n0 + 1)]
    extra = [2.0 ** (-4.0 * i / n0) for i in range(1, 2 * (n - n0), 2)]
    return tuple(first + extra)


def attend(
    query: F64,
    key: F64,
    value: F64,
    positions: NDArray[np.int64],
    scale: float,
    variant: AttentionVariant = PLAIN,
    *,
    first_key: int = 0,
) -> F64:
    """Causal attention over one sequence's contiguous K and V, with ``variant`` applied.

    ``query`` is ``[n, H, D]`` for tokens at ``positions``; ``key`` and
    ``value`` are ``[t, H_kv, D]`` for positions ``first_key .. first_key + t - 1``.
    The output is as wide as ``value``, which may be narrower than ``key``
    (:func:`attend_latent`).
    """
    group = query.shape[1] // key.shape[1]  # query head h reads KV head h // group
    k, v = np.repeat(key, group, axis=1), np.repeat(value, group, axis=1)
    key_pos = first_key + np.arange(key.shape[0])  # [t]
    distance = key_pos[None, :] - np.asarray(positions)[:, None]  # [n, t]; <= 0 if visible
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
        scores = np.einsum("nhd,thd->hnt", query, k) * scale  # [H, n, t], scaled
        if variant.softcap is not None:  # 1. soft-capping
            scores = variant.softcap * np.tanh(scores / variant.softcap)
        if variant.alibi_slopes is not None:  # 2. ALiBi
            scores = scores + np.asarray(variant.alibi_slopes)[:, None, None] * distance
    visible = distance <= 0  # 3. causal, and the window
    if variant.window is not None:
        visible &= distance > -variant.window
    q_ok = np.asarray(np.isfinite(query).all(axis=-1)).T  # [H, n]
    k_ok = np.asarray(np.isfinite(k).all(axis=-1)).T  # [H, t]
    refuse_overflow(scores, q_ok, k_ok, visible, scale, variant)
    scores = np.where(visible, scores, -np.inf)
    # 4. softmax, the sink (if any) one more logit in the denominator
    sink = np.full(query.shape[1], -np.inf) if variant.sinks is None else np.array(variant.sinks)
    top = np.maximum(scores.max(axis=-1), sink[:, None])[..., None]  # finite: a query sees itself
    weights = np.exp(scores - top)
    weights /= weights.sum(axis=-1, keepdims=True) + np.exp(sink[:, None, None] - top)
    out: F64 = np.einsum("hnt,thd->nhd", weights, v)
    return out


def latent_kv(c_kv: F64, k_rope: F64) -> tuple[F64, F64]:
    """What attention reads of latent rows ``[c_kv, k_rope]``: the key is the whole row, the
    value its first ``latent_dim`` columns (``c_kv``). Shapes ``[t, 1, latent_dim]`` and
    ``[t, 1, rope_dim]`` in; ``[t, 1, latent_dim + rope_dim]`` and ``[t, 1, latent_dim]`` out."""
    return np.concatenate([c_kv, k_rope], axis=-1), c_kv


def attend_latent(
    query: F64,
    c_kv: F64,
    k_rope: F64,
    positions: NDArray[np.int64],
    scale: float,
    variant: AttentionVariant = PLAIN,
    *,
    first_key: int = 0,
) -> F64:
    """Latent (absorbed multi-head latent) attention over one sequence's contiguous rows.

    ``query`` is ``[n, H, latent_dim + rope_dim]``, each head ``[q_latent,
    q_rope]``; ``c_kv`` ``[t, 1, latent_dim]`` and ``k_rope`` ``[t, 1,
    rope_dim]``. Returns ``[n, H, latent_dim]``: :func:`attend` with the one
    shared KV head :func:`latent_kv` reads.
    """
    key, value = latent_kv(c_kv, k_rope)
    return attend(query, key, value, positions, scale, variant, first_key=first_key)


def refuse_overflow(
    scores: F64,
    q_ok: NDArray[np.bool_],
    k_ok: NDArray[np.bool_],
    visible: NDArray[np.bool_],
    scale: float,
    variant: AttentionVariant,
) -> None:
    """Refuse scores that overflowed: a finite query and key must give a finite score.

    ``scores`` is ``[..., H, n, t]``; ``q_ok`` ``[..., H, n]`` and ``k_ok``
    ``[..., H, t]`` say which query and key rows are finite; ``visible``
    ``[..., n, t]``. A huge but finite scale or ALiBi slope (or huge values) can
    push ``scale * q . k`` or ``slope * (k - p)`` past the largest float, and the
    softmax of an infinite score is NaN (``inf - inf``): a silently wrong answer,
    so the spec refuses the call. A NaN that comes from the inputs (a read of a
    slot nobody wrote) is not an overflow: it flows through. Soft-capping bounds
    every score, so with a cap only ALiBi can overflow. One rule, for the plain
    definition and for the suite's batched path (:mod:`spec.attention_batched`).
    """
    finite = np.isfinite(scores)
    if finite.all():  # the common case: one pass, nothing more
        return
    bad = ~finite & visible[..., None, :, :] & q_ok[..., :, :, None] & k_ok[..., :, None, :]
    if not bad.any():
        return
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    head = where[-3]
    used = f"scale {scale!r}"
    if variant.alibi_slopes is not None:
        used += f", ALiBi slope {variant.alibi_slopes[head]!r}"
    raise ArgumentValueError(
        f"attention scores overflow {scores.dtype}: {used} give query head {head} (query row "
        f"{where[-2]}, key {where[-1]}) a score of {float(scores[where])} from a finite query "
        "and key; a softmax over overflowed scores is NaN or meaningless, so the call is "
        "refused: use a smaller scale or slope"
    )


def paged_attention(
    query: F64,
    batch: BatchMetadata,
    memory: KVMemory,
    layer: int,
    scale: float | None = None,
    *,
    variant: AttentionVariant | None = None,
    group: int = 0,
) -> F64:
    """Attention output ``[num_tokens, num_heads, head_dim]`` for every token of the batch
    (``[.., latent_dim]`` for a latent memory, whose query rows are ``[q_latent, q_rope]``).

    ``group`` is the KV cache group of ``layer``: whose block tables it reads
    (:meth:`spec.batch.BatchMetadata.tables`). A windowed layer gathers only
    the keys its queries can see, so blocks released before the window are
    never read.
    """
    variant, scale = check_attention(query, batch, memory, scale, variant)
    layer, group = check_layer_group(batch, memory, layer, group)
    out = np.empty((batch.num_tokens, query.shape[1], memory.value_dim))
    for i in range(batch.num_seqs):
        start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        k, v, positions, first = gather_visible(batch, memory, layer, group, variant, i)
        out[start:end] = attend(query[start:end], k, v, positions, scale, variant, first_key=first)
    return out


def check_attention(
    query: F64,
    batch: BatchMetadata,
    memory: KVMemory,
    scale: float | None,
    variant: AttentionVariant | None,
) -> tuple[AttentionVariant, float]:
    """Refuse a query, batch and memory that do not fit together; the variant and scale to use."""
    check_instance("batch", batch, BatchMetadata)
    check_instance("memory", memory, KVMemory)
    if not isinstance(query, np.ndarray) or query.dtype.kind != "f":
        raise ArgumentTypeError(
            f"query must be a numpy float array, got {type(query).__name__} "
            f"{getattr(query, 'dtype', '')}".rstrip()
        )
    variant = PLAIN if variant is None else check_instance("variant", variant, AttentionVariant)
    num_kv_heads, head_dim = memory.shape[2], memory.shape[3]
    if query.ndim != 3 or query.shape[0] < batch.num_tokens or query.shape[2] != head_dim:
        latent = memory.latent_dim
        parts = "" if latent is None else f" (q_latent {latent} + q_rope {head_dim - latent})"
        raise InvalidRequestError(
            f"query has shape {query.shape}, expected [{batch.num_tokens}, H, {head_dim}]{parts}"
        )
    if batch.block_size != memory.shape[1]:
        raise InvalidRequestError(
            f"the batch was laid out for block size {batch.block_size}, "
            f"but the KV memory has blocks of {memory.shape[1]}"
        )
    batch.validate(memory.shape[0])
    num_heads = query.shape[1]
    if num_heads % num_kv_heads:
        raise InvalidRequestError(f"{num_heads} query heads do not divide into {num_kv_heads}")
    variant.check_heads(num_heads)
    if scale is None and memory.latent_dim is not None:
        raise ArgumentValueError(
            "scale: a latent layout needs the model's softmax scale (DeepSeek's is "
            "1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)); it is never derived from the "
            f"row width {head_dim}"
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale("scale", scale)
    return variant, scale


def check_layer_group(
    batch: BatchMetadata, memory: KVMemory, layer: int, group: int
) -> tuple[int, int]:
    """``layer`` one of the memory's, ``group`` one of the batch's KV cache groups."""
    layer = check_int("layer", layer, low=0, high=memory.num_layers - 1)
    return layer, check_int("group", group, low=0, high=batch.num_groups - 1)


def gather_visible(
    batch: BatchMetadata,
    memory: KVMemory,
    layer: int,
    group: int,
    variant: AttentionVariant,
    i: int,
) -> tuple[F64, F64, NDArray[np.int64], int]:
    """Sequence ``i``'s K and V from its first visible key on, its query positions, that key.

    Of a latent memory, the K and V attention reads (:func:`latent_kv`).
    """
    start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
    positions = np.asarray(batch.positions[start:end], dtype=np.int64)
    first = variant.first_visible(int(positions[0]))
    k, v = memory.gather(layer, batch.tables(group)[i], batch.seq_lens[i], start=first)
    if memory.latent_dim is not None:
        k, v = latent_kv(k, v)
    return k, v, positions, first
