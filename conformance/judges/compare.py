"""Locating the first difference between what a backend holds or returns and what it should.

A difference is reported in the terms a person debugs in: which step, which
sequence and logical token, which layer, K or V or the attention output, which
head, the expected and actual vectors, and the largest absolute and relative
errors. KV is compared exactly; outputs against what a kernel of the same
precision may differ by (:mod:`conformance.judges.numerics`), whose figures the
report carries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from conformance.judges.dtypes import F64
from conformance.judges.numerics import ExampleErrors, OutputErrors
from spec.kv_geometry import KVGeometry

_SHOWN = 6  # vector elements shown in a report
FAULTS = ("exception", "shape", "input", "alias", "bounds", "hang", "crash", "internal")
"""Kinds of difference that are the backend (or the run) failing, rather than a wrong value.

``bounds``: a kernel accessed memory outside what :data:`spec.batch.PADDING_RULE`
allows (only with a bounds check on: :mod:`conformance.bounds.checker`); the detail
names the kernel, the argument, the offset and how far out of range it was.
"""


@dataclass(frozen=True)
class Difference:
    """The first place where the backend and the spec disagree."""

    what: str  # "K", "V", "output", "outputs" (a whole example's), or one of FAULTS
    step: int
    detail: str
    layer: int | None = None
    seq_id: int | None = None
    token: int | None = None  # logical position in the sequence
    head: int | None = None
    block: int | None = None
    offset: int | None = None
    expected: tuple[float, ...] = ()
    actual: tuple[float, ...] = ()
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    numerics: OutputErrors | None = None  # outputs: the error distribution and what was allowed
    example: ExampleErrors | None = None  # an example's outputs: imprecise or leaning
    diagnosis: str | None = None  # the named mistake that reproduces a wrong output, if any
    elements: tuple[int, ...] = ()  # which elements of the head ``expected`` shows (KV)

    def describe(self) -> str:
        """A few lines for a person: where, what, how far off."""
        where = [f"step {self.step}"]
        for label, value in (
            ("sequence", self.seq_id),
            ("token", self.token),
            ("block", self.block),
            ("offset", self.offset),
            ("layer", self.layer),
            ("head", self.head),
        ):
            if value is not None:
                where.append(f"{label} {value}")
        if self.what in FAULTS:
            lines = [f"the backend failed at {', '.join(where)}: {self.detail}"]
        else:
            lines = [f"{self.what} differs at {', '.join(where)}: {self.detail}"]
        if self.diagnosis:
            lines += [f"  {line.strip()}" for line in self.diagnosis.splitlines()]
        if self.expected or self.actual:
            at = f" (elements {', '.join(map(str, self.elements))})" if self.elements else ""
            lines.append(f"  expected {_fmt(self.expected)}{at}")
            lines.append(f"  actual   {_fmt(self.actual)}")
        if self.numerics is not None:
            lines += self.numerics.describe()
        elif self.max_abs_error is not None:
            lines.append(
                f"  max abs error {self.max_abs_error:.3g}, max rel error {self.max_rel_error:.3g}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _fmt(values: Sequence[float]) -> str:
    return (
        "[" + ", ".join(f"{v:.6g}" for v in values) + (", ...]" if len(values) >= _SHOWN else "]")
    )


def _errors(expected: F64, actual: F64) -> tuple[float, float]:
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        err = np.abs(actual - expected)
        rel = err / np.maximum(np.abs(expected), 1e-30)
    big = float("inf")
    abs_err = big if np.isnan(err).any() else float(err.max(initial=0.0))
    rel_err = big if np.isnan(rel).any() else float(rel.max(initial=0.0))
    return abs_err, rel_err


def first_kv_difference(
    step: int,
    layer: int,
    name: str,
    expected: F64,
    actual: F64,
    owners: Mapping[int, tuple[int, int]],
    block_size: int,
    slots: Sequence[int] | NDArray[np.int64] | None = None,
    block_offset: int = 0,
) -> Difference | None:
    """The first slot where ``actual`` is not bit-equal to ``expected`` (``[rows, H_kv, D]``).

    Row ``i`` is the spec's slot ``slots[i]`` (every slot in order by default:
    the suite may compare only some blocks). ``owners`` maps a slot to the live
    ``(sequence, token)`` stored there; a difference in a live token is
    reported before one in any other slot. The block reported is the
    backend's: the spec's plus ``block_offset``.
    """
    same = (expected == actual) | (np.isnan(expected) & np.isnan(actual))
    bad_rows = np.flatnonzero(~same.reshape(same.shape[0], -1).all(axis=1))
    if bad_rows.size == 0:
        return None
    slot_of = np.arange(expected.shape[0]) if slots is None else np.asarray(slots)
    live = [int(r) for r in bad_rows if int(slot_of[r]) in owners]
    row = min(live, key=lambda r: owners[int(slot_of[r])]) if live else int(bad_rows[0])
    slot = int(slot_of[row])
    head = int(np.flatnonzero(~same[row].all(axis=1))[0])
    shown = np.flatnonzero(~same[row, head])[:_SHOWN]  # the elements that differ, not the first
    seq_id, token = owners.get(slot, (None, None))
    if step == 0:
        detail = "the background write of every slot (before any step) did not store this value"
    elif seq_id is not None:
        detail = "the backend's cache holds other values than were written"
    else:
        detail = "a slot no live token owns differs from the spec: a missing or stray write or copy"
    shift = block_offset * block_size
    detail += _where_it_landed(expected, actual, row, slot_of + shift, block_size)
    abs_err, rel_err = _errors(expected[row], actual[row])
    return Difference(
        what=name,
        step=step,
        detail=detail,
        layer=layer,
        seq_id=seq_id,
        token=token,
        head=head,
        block=slot // block_size + block_offset,
        offset=slot % block_size,
        expected=tuple(float(x) for x in expected[row, head, shown]),
        actual=tuple(float(x) for x in actual[row, head, shown]),
        max_abs_error=abs_err,
        max_rel_error=rel_err,
        elements=tuple(int(i) for i in shown),
    )


def _where_it_landed(
    expected: F64, actual: F64, row: int, slots: NDArray[np.int64], block_size: int
) -> str:
    """Where the backend holds the row the spec expects at ``row``, if anywhere else compared.

    >>> exp = np.array([[[1.0]], [[2.0]], [[3.0]]])
    >>> _where_it_landed(exp, np.array([[[1.0]], [[9.0]], [[2.0]]]), 1, np.arange(3), 2)
    '; the expected row is in slot 2 (block 1, offset 0)'
    """
    rows = actual.reshape(actual.shape[0], -1)
    found = np.flatnonzero((rows == expected[row].reshape(-1)).all(axis=1))
    found = found[found != row]
    if found.size == 0:
        return "; the expected row is in no slot compared"
    at = int(slots[int(found[0])])
    more = f" and {found.size - 1} other slots" if found.size > 1 else ""
    return (
        f"; the expected row is in slot {at} (block {at // block_size}, "
        f"offset {at % block_size}){more}"
    )


def first_output_difference(
    step: int,
    layer: int,
    expected: F64,
    actual: F64,
    errors: OutputErrors,
    rows: Sequence[tuple[int, int]],
    poison: str | None = None,
    spread: F64 | None = None,
) -> Difference | None:
    """The first row and head of ``actual`` (``[T, H, D]``) off by more than ``errors`` allows.

    ``rows[i]`` is the ``(sequence, token)`` of row ``i``; ``errors`` judges
    the whole step and layer (:func:`conformance.judges.numerics.output_errors`).
    The detail gives that row's own error and multiple, and the step's worst,
    which the numerics lines below repeat; ``spread``: the sigmas of probability rounding
    ``errors`` was judged with, if any. ``poison``: what the example filled
    every slot no live token owns with (``"NaN"``, ``"+inf"``, ``"-inf"``); a
    non-finite output where the reference is finite is then named a read of one.
    """
    if errors.passed:
        return None
    ulps = errors.ulps(expected, actual, spread)
    bad = (ulps > errors.allowed_ulps).any(axis=2)  # [T, H]
    row, head = (int(i) for i in np.argwhere(bad)[0])
    seq_id, token = rows[row]
    here = float(ulps[row, head].max())
    if poison is not None and not np.isfinite(actual[row, head]).all():
        detail = (
            f"the output is not finite where the reference is, in an example whose slots no "
            f"token owns hold {poison} (as a kernel that reads one, even to multiply it by "
            "zero, gives)"
        )
    else:
        detail = (
            f"attention output off by {here:.3g} ulp here, {here / errors.allowed_ulps:.2f} x "
            f"the allowed {errors.allowed_ulps:.3g} ulp (the step and layer's worst: "
            f"{errors.excess:.2f} x, below)"
        )
    return Difference(
        what="output",
        step=step,
        detail=detail,
        layer=layer,
        seq_id=seq_id,
        token=token,
        head=head,
        expected=tuple(float(x) for x in expected[row, head, :_SHOWN]),
        actual=tuple(float(x) for x in actual[row, head, :_SHOWN]),
        max_abs_error=errors.max_error,
        max_rel_error=errors.max_rel_error,
        numerics=errors,
    )


def example_difference(step: int, errors: ExampleErrors) -> Difference | None:
    """A difference for an example whose outputs are imprecise on average, or lean one way."""
    if errors.passed:
        return None
    return Difference(what="outputs", step=step, detail=errors.describe(), example=errors)


def latent_part_note(g: KVGeometry, name: str) -> str:
    """What a latent read's part holds, for a shape difference (nothing otherwise).

    >>> latent_part_note(KVGeometry(1, 4, 2, 1, 48, latent_dim=32), "k_rope")
    ' (k_rope: the rope_dim 16 columns of the latent row)'
    """
    if not g.is_latent:
        return ""
    width = f"latent_dim {g.latent_dim}" if name == "c_kv" else f"rope_dim {g.rope_dim}"
    return f" ({name}: the {width} columns of the latent row)"


def latent_output_note(g: KVGeometry) -> str:
    """What a latent attention's output is, for a shape difference (nothing otherwise)."""
    if not g.is_latent:
        return ""
    return (
        f" (latent layout: [T, H, latent_dim {g.latent_dim}], the weighted sum of c_kv; not "
        f"the query's width {g.head_dim}, nor per-head values)"
    )
