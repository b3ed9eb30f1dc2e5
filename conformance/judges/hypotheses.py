"""Naming the bug behind a wrong attention output: the reference recomputed under known mistakes.

A wrong GQA head mapping or a causal mask off by one is not a precision
problem, and a report that says "68567 x the allowed error" points away from
it. When an output differs, :func:`diagnose` recomputes the step's attention
in float64 under each named mistake of :data:`HYPOTHESES` (the KV head
mapping, the causal mask off by one either way, the window edge, the scale
missing, applied twice or left at ``1/sqrt(D)``, the soft-cap before the
scale, a sink missing or counted twice, the ALiBi sign, a per-KV-head slope
or an origin at key 0, a neighbour's block-table row, K and V scales
swapped; of a latent layer, the rope part left out of the score and V read
at the rope columns) and names the one that reproduces the backend's output: its error
against the backend must be a small share (:data:`EXPLAINED`) of the
reference's, and the smallest of all.

>>> from spec.attention import PLAIN
>>> q = np.ones((1, 4, 2)); k = np.arange(8.0).reshape(2, 2, 2); v = k + 1
>>> case = Case(q, [(k, v, np.array([1]), 0)], 1.0, PLAIN, (1.0, 1.0))
>>> exact = attend_with(case, Mistake())
>>> wrong = attend_with(case, Mistake(head_map="mod"))
>>> diagnose(case, exact, wrong).splitlines()[0]
'matches attention with KV head h % H_kv: the GQA head mapping'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from conformance.interpreter.arithmetic import tf32
from conformance.judges.dtypes import F64, round_to
from spec.attention import AttentionVariant, latent_kv
from spec.batch import BatchMetadata
from spec.block_manager import cdiv
from spec.kv_memory import KVMemory
from spec.quant import round_fp8

EXPLAINED = 0.1
"""A mistake explains an output when its error against the backend is at most this share of the
reference's (and the smallest of all mistakes tried)."""

_Keys = tuple[F64, F64, NDArray[np.int64], int]
"""One sequence's K ``[t, H_kv, D]``, V, query positions and first key position."""


@dataclass(frozen=True)
class Mistake:
    """One way to compute attention wrong; the defaults compute it right."""

    head_map: str = "div"  # "div": h // (H / H_kv); "mod": h % H_kv
    causal: int = 0  # the query at p sees keys <= p + causal
    window: int = 0  # added to the layer's window
    scale: str = "given"  # "given", "one" (missing), "twice" (squared), "default" (1/sqrt(D))
    softcap_unscaled: bool = False  # the cap applied to q . k before the scale
    sink_weight: float = 1.0  # 0: the sink left out, 2: counted twice
    alibi_sign: float = 1.0
    alibi_kv_slope: bool = False  # head h uses the slope of head h // (H / H_kv)
    alibi_from_zero: bool = False  # the bias is slope * k, not slope * (k - p)
    row_shift: int = 0  # sequence i reads the block-table row i + row_shift
    kv_scales_swapped: bool = False
    past_length: bool = False  # the last block read whole: its slots past seq_len taken as keys
    products: str = "exact"  # "tf32", "activation", "fp8", "normalised": rounded so (PRODUCTS)
    latent_no_rope: bool = False  # latent: the score q_latent . c_kv alone, no rope part
    latent_value_late: bool = False  # latent: V read latent_dim wide from the row's end


HYPOTHESES: tuple[tuple[str, Mistake], ...] = (
    ("attention with KV head h % H_kv: the GQA head mapping", Mistake(head_map="mod")),
    (
        "attention whose query at position p also sees key p + 1: the causal mask off by one",
        Mistake(causal=1),
    ),
    (
        "attention without the query's own token (keys before p only): the causal mask off by "
        "one, own token missing",
        Mistake(causal=-1),
    ),
    ("attention with a window one key wider: the window edge off by one", Mistake(window=1)),
    ("attention with a window one key narrower: the window edge off by one", Mistake(window=-1)),
    ("attention without the softmax scale (scale 1)", Mistake(scale="one")),
    ("attention with the softmax scale applied twice", Mistake(scale="twice")),
    ("attention with scale 1/sqrt(D) instead of the one given", Mistake(scale="default")),
    (
        "attention with the soft-cap applied before the scale: the soft-cap order",
        Mistake(softcap_unscaled=True),
    ),
    (
        "attention without the sink in the softmax denominator: the sink missing",
        Mistake(sink_weight=0.0),
    ),
    ("attention with the sink counted twice: the sink doubled", Mistake(sink_weight=2.0)),
    ("attention with the ALiBi bias sign flipped", Mistake(alibi_sign=-1.0)),
    (
        "attention with ALiBi slopes indexed by KV head: a per-KV-head slope",
        Mistake(alibi_kv_slope=True),
    ),
    (
        "attention with the ALiBi bias measured from key 0 (slope * k): the ALiBi origin",
        Mistake(alibi_from_zero=True),
    ),
    (
        "attention through the next sequence's block-table row: a table row shifted",
        Mistake(row_shift=1),
    ),
    (
        "attention through the previous sequence's block-table row: a table row shifted",
        Mistake(row_shift=-1),
    ),
    ("attention with the K and V fp8 scales swapped", Mistake(kv_scales_swapped=True)),
    (
        "attention over the whole last block, its slots past seq_len included: stale KV of "
        "the block's previous owner read as keys",
        Mistake(past_length=True),
    ),
    (
        "attention whose float32 products take TF32 operands (tl.dot's default precision on "
        'NVIDIA GPUs): products rounded to TF32; use input_precision="ieee", or declare '
        'products="tf32"',
        Mistake(products="tf32"),
    ),
    (
        "attention whose q.k products are each rounded to the activation dtype before the sum: "
        'q.k products rounded to the activation dtype; or declare products="activation"',
        Mistake(products="activation"),
    ),
    (
        'attention with Q and P cast to the fp8 cache dtype: or declare products="fp8"',
        Mistake(products="fp8"),
    ),
    (
        "attention whose normalised probabilities are rounded to the activation dtype before "
        "P @ V (an eager softmax, then a matrix product): probabilities rounded after "
        'normalising; or declare products="normalised"',
        Mistake(products="normalised"),
    ),
    (
        "latent attention whose scores leave out the rope part (q_latent . c_kv alone): "
        "the rope part of the score missing",
        Mistake(latent_no_rope=True),
    ),
    (
        "latent attention whose V is read latent_dim wide from the row's end (rope_dim "
        "columns late, into k_rope): the value offset",
        Mistake(latent_value_late=True),
    ),
)
"""Each named mistake, as the report names it."""


@dataclass(frozen=True)
class Case:
    """One step and layer's attention: queries ``[T, H, D]`` and what each sequence reads.

    ``keys``: per sequence, its K and V (dequantized), query positions and first
    key position; ``scale``, ``variant`` and the layer's ``(k_scale, v_scale)``
    (``(1, 1)`` unquantized). ``wider``: each sequence's keys from one position
    earlier; ``whole``: to the end of its last block; ``shifted``: for a shifted
    table row, each sequence's keys read through its neighbours' rows (``None``
    where the row cannot hold the sequence).
    """

    query: F64
    keys: Sequence[_Keys]
    scale: float
    variant: AttentionVariant
    kv_scales: tuple[float, float]
    wider: Sequence[_Keys | None] = ()  # each sequence's keys from one position earlier
    whole: Sequence[_Keys | None] = ()  # each sequence's keys to the end of its last block
    shifted: dict[int, Sequence[_Keys | None]] | None = None  # row shift -> keys through it
    dtype: str = "float32"  # the activation dtype (the product mistakes depend on it)
    kv_dtype: str | None = None  # the fp8 cache dtype, if any
    latent_dim: int | None = None  # a latent layer: keys are rows, values their c_kv


def case_for(
    query: F64,
    batch: BatchMetadata,
    memory: KVMemory,
    layer: int,
    group: int,
    scale: float,
    variant: AttentionVariant,
    dtype: str = "float32",
) -> Case:
    """The :class:`Case` of one attention call, read from the spec's memory."""
    scales = memory.kv_scales[layer] if memory.kv_dtype is not None else (1.0, 1.0)
    tables = batch.tables(group)
    keys, wider, whole = [], [], []
    shifted: dict[int, list[_Keys | None]] = {1: [], -1: []}
    b = memory.shape[1]
    for i in range(batch.num_seqs):
        start, end = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        positions = np.asarray(batch.positions[start:end], dtype=np.int64)
        first = variant.first_visible(int(positions[0])) if positions.size else 0
        n = batch.seq_lens[i]
        keys.append((*_read(memory, layer, tables[i], n, first), positions, first))
        wider.append(_try_gather(memory, layer, tables[i], n, max(0, first - 1), positions))
        whole.append(_try_gather(memory, layer, tables[i], cdiv(n, b) * b, first, positions))
        for shift in (1, -1):
            j = (i + shift) % batch.num_seqs
            got = _try_gather(memory, layer, tables[j], n, first, positions)
            shifted[shift].append(got if j != i else None)
    shifts: dict[int, Sequence[_Keys | None]] = dict(shifted)
    return Case(
        query,
        keys,
        scale,
        variant,
        scales,
        wider,
        whole,
        shifts,
        dtype,
        memory.kv_dtype,
        memory.latent_dim,
    )


def _try_gather(
    memory: KVMemory,
    layer: int,
    table: Sequence[int],
    n: int,
    first: int,
    positions: NDArray[np.int64],
) -> _Keys | None:
    """A sequence's keys through ``table`` from ``first``, or ``None`` where it cannot hold them."""
    b = memory.shape[1]
    used = table[first // b : -(-n // b)]
    if len(table) * b < n or any(not 0 <= x < memory.shape[0] for x in used):
        return None
    k, v = _read(memory, layer, table, n, first)
    if not (np.isfinite(k).all() and np.isfinite(v).all()):
        return None
    return k, v, positions, first


def _read(
    memory: KVMemory, layer: int, table: Sequence[int], n: int, first: int
) -> tuple[F64, F64]:
    """The K and V attention reads of positions ``first .. n - 1`` (of a latent memory, the
    row and its c_kv: :func:`spec.attention.latent_kv`)."""
    k, v = memory.gather(layer, table, n, start=first)
    return (k, v) if memory.latent_dim is None else latent_kv(k, v)


def needs(mistake: Mistake) -> frozenset[str]:
    """The attention variants (:data:`spec.attention.VARIANTS`) a mistake is about.

    >>> sorted(needs(Mistake(alibi_from_zero=True))), sorted(needs(Mistake(causal=1)))
    (['alibi'], [])
    """
    about = {
        "window": mistake.window != 0,
        "softcap": mistake.softcap_unscaled,
        "sinks": mistake.sink_weight != 1.0,
        "alibi": mistake.alibi_sign != 1.0 or mistake.alibi_kv_slope or mistake.alibi_from_zero,
    }
    return frozenset(name for name, on in about.items() if on)


def named(diagnosis: str | None) -> Mistake | None:
    """The mistake a :func:`diagnose` line names, if any."""
    found = named_with_name(diagnosis)
    return None if found is None else found[1]


def named_with_name(diagnosis: str | None) -> tuple[str, Mistake] | None:
    """The short name (after its last colon) and the mistake a :func:`diagnose` line names.

    >>> named_with_name("matches attention with KV head h % H_kv: the GQA head mapping")[0]
    'the GQA head mapping'
    """
    if not diagnosis or not diagnosis.startswith("matches "):
        return None
    first = diagnosis.splitlines()[0].removeprefix("matches ")
    for name, m in HYPOTHESES:
        if name == first:
            return name.rsplit(": ", 1)[-1].split(";")[0], m
    return None


def attend_with(case: Case, mistake: Mistake) -> F64 | None:
    """The step's output ``[T, H, D]`` computed with ``mistake``; ``None`` where it does not
    apply (a soft-cap mistake on a layer without one, a shifted row that cannot hold a sequence)."""
    v = case.variant
    if not needs(mistake) <= v.features:
        return None
    if (mistake.latent_no_rope or mistake.latent_value_late) and case.latent_dim is None:
        return None
    if mistake.kv_scales_swapped and case.kv_scales[0] == case.kv_scales[1]:
        return None
    if not _products_apply(mistake.products, case):
        return None
    keys: Sequence[_Keys | None] = case.keys
    if mistake.row_shift:
        if case.shifted is None or len(case.keys) < 2:
            return None
        keys = case.shifted[mistake.row_shift]
    elif mistake.window > 0:
        keys = case.wider
    elif mistake.past_length:
        keys = case.whole
    if len(keys) != len(case.keys):
        return None  # a case built without these keys (``wider``, ``whole``): not tried
    width = case.keys[0][1].shape[2] if case.keys else case.query.shape[2]  # V's (latent: c_kv)
    out = np.zeros((*case.query.shape[:2], width))
    row = 0
    for got in keys:
        if got is None:
            return None
        k, val, positions, first = got
        if mistake.kv_scales_swapped:
            ks, vs = case.kv_scales
            k, val = k / ks * vs, val / vs * ks
        if mistake.latent_no_rope:
            k = np.concatenate([k[..., : val.shape[2]], np.zeros_like(k[..., val.shape[2] :])], -1)
        if mistake.latent_value_late:
            val = k[..., k.shape[2] - val.shape[2] :]
        n = positions.size
        out[row : row + n] = _attend(
            case.query[row : row + n], k, val, positions, first, case, mistake
        )
        row += n
    return out


def _products_apply(products: str, case: Case) -> bool:
    """Whether rounding products as ``products`` changes anything for ``case``'s dtypes."""
    return {
        "exact": True,
        "tf32": case.dtype == "float32",
        "activation": case.dtype != "float32",
        "fp8": case.kv_dtype is not None,
        "normalised": case.dtype != "float32",
    }[products]


def _operand(x: F64, m: Mistake, case: Case, fp8: bool = False) -> F64:
    """A product's operand as a kernel with mistake ``m`` reads it: TF32, or cast to fp8."""
    if m.products == "tf32":
        out: F64 = tf32(x.astype(np.float32)).astype(np.float64)
        return out
    if m.products == "fp8" and fp8 and case.kv_dtype is not None:
        return round_fp8(x, case.kv_dtype)
    return x


def _attend(
    q: F64, k: F64, v: F64, positions: NDArray[np.int64], first: int, case: Case, m: Mistake
) -> F64:
    """Float64 attention of one sequence's queries over its keys, with mistake ``m``."""
    variant = case.variant
    q, k, v = _operand(q, m, case, fp8=True), _operand(k, m, case), _operand(v, m, case)
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    scale = {
        "given": case.scale,
        "one": 1.0,
        "twice": case.scale * case.scale,
        "default": 1.0 / math.sqrt(d),
    }[m.scale]
    key_pos = first + np.arange(k.shape[0])
    visible = key_pos[None, :] <= positions[:, None] + m.causal
    if m.past_length:  # keys past the sequence's last position, seen by every query
        visible |= key_pos[None, :] > positions[-1]
    if variant.window is not None:
        w = variant.window + m.window
        visible &= key_pos[None, :] > positions[:, None] - w
    out = np.zeros((*q.shape[:2], v.shape[2]))
    for h in range(heads):
        kv = h % kv_heads if m.head_map == "mod" else h // group
        if m.products == "activation":  # each q_d * k_d rounded to the dtype, then summed
            raw = round_to(q[:, h, None, :] * k[None, :, kv], case.dtype).sum(axis=-1)
        else:
            raw = q[:, h] @ k[:, kv].T
        scores = raw * scale
        if variant.softcap is not None:
            c = variant.softcap
            scores = c * np.tanh(raw / c) * scale if m.softcap_unscaled else c * np.tanh(scores / c)
        if variant.alibi_slopes is not None:
            slope = variant.alibi_slopes[h // group if m.alibi_kv_slope else h] * m.alibi_sign
            origin = 0 if m.alibi_from_zero else positions[:, None]
            scores = scores + slope * (key_pos[None, :] - origin)
        scores = np.where(visible, scores, -np.inf)
        top = scores.max(axis=-1, keepdims=True)
        sink = None if variant.sinks is None else variant.sinks[h]
        if sink is not None:
            top = np.maximum(top, sink)
        top = np.where(np.isfinite(top), top, 0.0)
        weights = np.exp(scores - top)
        total = weights.sum(axis=-1, keepdims=True)
        if sink is not None:
            total = total + m.sink_weight * np.exp(sink - top)
        with np.errstate(invalid="ignore", divide="ignore"):
            if m.products in ("tf32", "fp8"):  # P rounded unnormalised, as a kernel's P @ V
                out[:, h] = (_operand(weights, m, case, fp8=True) @ v[:, kv]) / total
            elif m.products == "normalised":  # an eager softmax: P / sum rounded, then P @ V
                out[:, h] = round_to(weights / total, case.dtype) @ v[:, kv]
            else:
                out[:, h] = (weights / total) @ v[:, kv]
    return out


def diagnose(case: Case, expected: F64, actual: F64) -> str | None:
    """The line naming the mistake that reproduces ``actual``, or ``None`` if none does.

    ``expected`` is the reference output of ``case``. Not tried where the
    backend's output is not finite (that is reported as a read of poison or an
    overflow instead).
    """
    if not np.isfinite(actual).all():
        return None
    base = _distance(expected, actual)
    if base == 0.0:
        return None
    best: tuple[float, str] | None = None
    for name, mistake in HYPOTHESES:
        with np.errstate(all="ignore"):
            got = attend_with(case, mistake)
        if got is None or not np.isfinite(got).all():
            continue
        got = round_to(got, case.dtype)  # as a kernel hands it back: in its activation dtype
        d = _distance(got, actual)
        if d <= EXPLAINED * base and (best is None or d < best[0]):
            best = (d, name)
    if best is None:
        return None
    share = best[0] / base
    return (
        f"matches {best[1]}\n"
        f"  (that recomputation leaves {share:.1%} of the reference's error; "
        f"{len(HYPOTHESES)} named mistakes tried)"
    )


def _distance(a: F64, b: F64) -> float:
    return float(np.abs(a - b).max(initial=0.0))
