"""Reference paged attention, in float64: what every backend must compute.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


@dataclass(frozen=True)
class Precision:
    """How a lower-precision kernel computes the same attention: the arithmetic, and what it rounds.

    The default is the spec itself: float64 throughout, probabilities
    normalised before the ``P @ V`` product. With ``compute="float32"`` every
    product and sum is float32 (float32 accumulation, as a kernel's tensor-core
    dot does); ``round_kv`` is applied to the K and V a kernel reads (an fp8
    cache dequantized to the activation dtype); ``round_p`` to the
    *unnormalised* probabilities ``exp(s - max)`` before ``P @ V``, as a
    half-precision kernel does, which then divides by their (unrounded)
    float32 sum. The conformance suite uses it for its same-precision
    reference (:mod:`conformance.judges.numerics`).
    """

    compute: str = "float64"  # the dtype of every product and sum: "float64" or "float32"
    round_kv: Callable[[F64], F64] | None = None  # applied to the K and V read; None: as stored
    round_p: Callable[[F64], F64] | None = None  # applied to exp(s - max) before P @ V

    @property
    def exact(self) -> bool:
        """True for the spec's own arithmetic (float64, nothing rounded)."""
        return self.compute == "float64" and self.round_kv is None and self.round_p is None


EXACT = Precision()
"""The spec's own arithmetic: float64, nothing rounded."""

_DECODE_CHUNK_ELEMENTS = 1 << 22
"""Padded K elements per vectorised group of decodes: bounds the reference's temporary memory."""


def paged_attention(
    query: F64,
    batch: BatchMetadata,
    memory: KVMemory,
    layer: int,
    scale: float | None = None,
    *,
    variant: AttentionVariant | None = None,
    group: int = 0,
    precision: Precision = EXACT,
) -> F64:
    """Attention output ``[num_tokens, num_heads, head_dim]`` for every token of the batch.

    ``group`` is the KV cache group of ``layer``: whose block tables it reads
    (:meth:`spec.batch.BatchMetadata.tables`). A windowed layer gathers only
    the keys its queries can see, so blocks released before the window are
    never read. Single-token queries (decodes) of many sequences are computed
    together, padded to the longest context of a group: the same arithmetic
    per sequence, without a Python loop over hundreds of them.
    """
    check_instance("batch", batch, BatchMetadata)
    check_instance("memory", memory, KVMemory)
    if not isinstance(query, np.ndarray) or query.dtype.kind != "f":
        raise ArgumentTypeError(
            f"query must be a numpy float array, got {type(query).__name__} "
            f"{getattr(query, 'dtype', '')}".rstrip()
        )
    variant = PLAIN if variant is None else check_instance("variant", variant, AttentionVariant)
    check_instance("precision", precision, Precision)
    group = check_int("group", group, low=0, high=batch.num_groups - 1)
    layer = check_int("layer", layer, low=0, high=memory.num_layers - 1)
    num_kv_heads, head_dim = memory.shape[2], memory.shape[3]
    if query.ndim != 3 or query.shape[0] < batch.num_tokens or query.shape[2] != head_dim:
        raise InvalidRequestError(
            f"query has shape {query.shape}, expected [{batch.num_tokens}, H, {head_dim}]"
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
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale("scale", scale)
    out = np.empty((batch.num_tokens, num_heads, head_dim))  # every row is some sequence's
    decodes = [i for i in range(batch.num_seqs) if batch.query_len(i) == 1]
    for chunk in _decode_groups(batch, decodes, num_kv_heads * head_dim):
        rows = [batch.query_start_loc[i] for i in chunk]
        keys = [_gather(batch, memory, layer, group, variant, i, precision) for i in chunk]
        out[rows] = _attend_padded(query[rows][:, None], keys, scale, variant, precision)[:, 0]
    for i in range(batch.num_seqs):
        if batch.query_len(i) > 1:
            start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            keys = [_gather(batch, memory, layer, group, variant, i, precision)]
            out[start:end] = _attend_padded(
                query[None, start:end], keys, scale, variant, precision
            )[0]
    return out


_Keys = tuple[F64, F64, NDArray[np.int64], int]
"""One sequence's K and V, its query positions, and the position of its first key."""


def _gather(
    batch: BatchMetadata,
    memory: KVMemory,
    layer: int,
    group: int,
    variant: AttentionVariant,
    i: int,
    precision: Precision,
) -> _Keys:
    start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
    positions = np.asarray(batch.positions[start:end], dtype=np.int64)
    first = variant.first_visible(int(positions[0]))
    k, v = memory.gather(layer, batch.tables(group)[i], batch.seq_lens[i], start=first)
    if precision.round_kv is not None:
        k, v = precision.round_kv(k), precision.round_kv(v)
    return k, v, positions, first


def _decode_groups(batch: BatchMetadata, decodes: list[int], row_elements: int) -> list[list[int]]:
    """Decodes in groups of similar context length, each padded group under a memory bound."""
    ordered = sorted(decodes, key=lambda i: batch.seq_lens[i])
    groups: list[list[int]] = []
    for i in ordered:
        if groups and (len(groups[-1]) + 1) * batch.seq_lens[i] * row_elements <= (
            _DECODE_CHUNK_ELEMENTS
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _attend_padded(
    query: F64, keys: list[_Keys], scale: float, variant: AttentionVariant, precision: Precision
) -> F64:
    """:func:`attend` for ``S`` sequences at once: ``query`` is ``[S, n, H, D]``, out the same.

    Each sequence's keys are padded with zeros to the longest; padded keys are
    invisible (their weight is exactly zero), so each sequence's result is its
    own.
    """
    width = max(k.shape[0] for k, _, _, _ in keys)
    s, (h_kv, d) = len(keys), keys[0][0].shape[1:]
    dt = np.dtype(precision.compute)
    k_all, v_all = np.zeros((s, h_kv, width, d), dt), np.zeros((s, h_kv, width, d), dt)
    key_pos = np.zeros((s, width), dtype=np.int64)
    valid = np.zeros((s, width), dtype=np.bool_)
    for j, (k, v, _, first) in enumerate(keys):
        k_all[j, :, : k.shape[0]] = k.transpose(1, 0, 2)
        v_all[j, :, : k.shape[0]] = v.transpose(1, 0, 2)
        key_pos[j] = first + np.arange(width)
        valid[j, : k.shape[0]] = True
    positions = np.stack([p for _, _, p, _ in keys])
    return _attend_batch(query, k_all, v_all, positions, key_pos, valid, scale, variant, precision)


def attend(
    query: F64,
    key: F64,
    value: F64,
    positions: NDArray[np.int64],
    scale: float,
    variant: AttentionVariant = PLAIN,
    *,
    first_key: int = 0,
    precision: Precision = EXACT,
) -> F64:
    """Causal attention over one sequence's contiguous K and V, with ``variant`` applied.

    ``query`` is ``[n, H, D]`` for tokens at ``positions``; ``key`` and
    ``value`` are ``[t, H_kv, D]`` for positions ``first_key .. first_key + t - 1``.
    """
    key_pos = first_key + np.arange(key.shape[0])[None]
    valid = np.ones(key_pos.shape, dtype=np.bool_)
    out = _attend_batch(
        query[None],
        key.transpose(1, 0, 2)[None],
        value.transpose(1, 0, 2)[None],
        np.asarray(positions)[None],
        key_pos,
        valid,
        scale,
        variant,
        precision,
    )
    first: F64 = out[0]
    return first


def _attend_batch(
    query: F64,
    key: F64,
    value: F64,
    positions: NDArray[np.int64],
    key_pos: NDArray[np.int64],
    valid: NDArray[np.bool_],
    scale: float,
    variant: AttentionVariant,
    precision: Precision,
) -> F64:
    """The arithmetic of attention, batched over a leading sequence axis.

    ``query`` ``[S, n, H, D]`` at ``positions`` ``[S, n]``; ``key``/``value``
    ``[S, H_kv, t, D]`` (head-major, as a kernel tiles them) at ``key_pos``
    ``[S, t]``, of which ``valid`` are real.
    Query head ``h`` reads KV head ``h // g`` with ``g = H / H_kv``: the heads
    of one KV head form one matrix, so K and V are never repeated per head.
    """
    dt = np.dtype(precision.compute)
    s, n, num_heads, d = query.shape
    h_kv, t = key.shape[1], key.shape[2]
    g = num_heads // h_kv
    # [S, H_kv, g * n, D]: rows of one KV head's group; the g query heads of KV head j are j*g..
    q = np.asarray(query, dt).reshape(s, n, h_kv, g, d).transpose(0, 2, 3, 1, 4)
    q = q.reshape(s, h_kv, -1, d)
    k = np.asarray(key, dt).transpose(0, 1, 3, 2)  # [S, H_kv, D, t]
    v = np.asarray(value, dt)
    # In place where it can be: at production sizes each temporary is tens of megabytes.
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below
        scores = (q @ k).reshape(s, num_heads, n, t)
        scores *= dt.type(scale)
        if variant.softcap is not None:
            cap = dt.type(variant.softcap)
            scores /= cap
            np.tanh(scores, out=scores)
            scores *= cap
        if variant.alibi_slopes is not None:
            distance = key_pos[:, None, :] - positions[:, :, None]  # [S, n, t], <= 0 if visible
            slopes = np.asarray(variant.alibi_slopes, dtype=dt)[None, :, None, None]
            scores += slopes * distance[:, None].astype(dt)
    visible = (key_pos[:, None, :] <= positions[:, :, None]) & valid[:, None, :]  # [S, n, t]
    if variant.window is not None:
        visible &= key_pos[:, None, :] > positions[:, :, None] - variant.window
    _check_scores(scores, query, key, visible, positions, key_pos, scale, variant)
    np.copyto(scores, dt.type(-np.inf), where=~visible[:, None])
    top = scores.max(axis=-1, keepdims=True)  # finite: every query sees itself
    if variant.sinks is not None:
        sinks = np.asarray(variant.sinks, dtype=dt)[None, :, None, None]  # [1, H, 1, 1]
        top = np.maximum(top, sinks)
    scores -= top
    weights = np.exp(scores, out=scores)
    total = weights.sum(axis=-1, keepdims=True)
    if variant.sinks is not None:
        total = total + np.exp(sinks - top)
    if precision.round_p is None:
        weights /= total
        mixed = weights.reshape(s, h_kv, -1, t) @ v
    else:
        p = precision.round_p(weights).astype(dt)
        mixed = (p.reshape(s, h_kv, -1, t) @ v) / total.reshape(s, h_kv, -1, 1)
    out: F64 = mixed.reshape(s, h_kv, g, n, d).transpose(0, 3, 1, 2, 4).reshape(s, n, num_heads, d)
    return out.astype(np.float64)


def _check_scores(
    scores: F64,
    query: F64,
    key: F64,
    visible: NDArray[np.bool_],
    positions: NDArray[np.int64],
    key_pos: NDArray[np.int64],
    scale: float,
    variant: AttentionVariant,
) -> None:
    """Refuse scores that overflowed: a finite query and key must give a finite score.

    A huge but finite scale or ALiBi slope (or huge values) can push ``scale *
    q . k`` or ``slope * (k - p)`` past the largest float, and the softmax of an
    infinite score is NaN (``inf - inf``): a silently wrong answer, so the spec
    refuses the call instead. A NaN that comes from the inputs (a read of a slot
    nobody wrote) is not an overflow: it flows through, as everywhere in the spec.
    Soft-capping bounds every score, so with a cap only ALiBi can overflow.
    """
    finite = np.isfinite(scores)
    if finite.all():  # the common case: one pass, nothing more
        return
    num_heads, h_kv = scores.shape[1], key.shape[1]
    q_ok = np.asarray(np.isfinite(query).all(axis=-1))  # [S, n, H]
    k_ok = np.asarray(np.isfinite(key).all(axis=-1))  # [S, H_kv, t]
    q_ok = q_ok.transpose(0, 2, 1)  # [S, H, n]
    k_ok = np.repeat(k_ok, num_heads // h_kv, axis=1)  # [S, H, t]: head h reads KV head h // g
    bad = ~finite & visible[:, None] & q_ok[..., None] & k_ok[:, :, None, :]
    if not bad.any():
        return
    s, h, j, t = (int(x) for x in np.argwhere(bad)[0])
    used = f"scale {scale!r}"
    if variant.alibi_slopes is not None:
        used += f", ALiBi slope {variant.alibi_slopes[h]!r}"
    raise ArgumentValueError(
        f"attention scores overflow {scores.dtype}: {used} give query head {h} at position "
        f"{int(positions[s, j])} a score of {float(scores[s, h, j, t])} against the key at "
        f"position {int(key_pos[s, t])} from a finite query and key; a softmax over overflowed "
        "scores is NaN or meaningless, so the call is refused: use a smaller scale or slope"
    )
