"""Block tables as wide as the backend asks (``Capabilities.table_width``), padded as the rule says.

The suite hands every attention call tables at least ``table_width`` wide,
padded with ``PAD_BLOCK`` (:mod:`conformance.lockstep.tables`); the spec's
reference reads them the same; bad widths are refused by name.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.lockstep.tables import pad_tables
from conformance.run.runner import run_suite
from spec.backend import Capabilities, FloatArray
from spec.batch import PAD_BLOCK, BatchMetadata
from spec.errors import InvalidRequestError

WIDTH = 40


class WantsWideTables(NumpyPagedBackend):
    """The numpy backend, declaring an engine's persistent table; records the widths it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: set[int] = set()

    @property
    def capabilities(self) -> Capabilities:
        caps = super().capabilities
        return Capabilities(name="wide", kv_groups=caps.kv_groups, table_width=WIDTH)

    def attention(
        self, layer: int, query: FloatArray, batch: BatchMetadata, scale: float, **kw: object
    ) -> FloatArray:
        for g in range(batch.num_groups):
            self.widths |= {len(row) for row in batch.tables(g)}
        return super().attention(layer, query, batch, scale, **kw)  # type: ignore[arg-type]


def test_the_suite_hands_tables_as_wide_as_declared() -> None:
    backend = WantsWideTables()
    result = run_suite(
        backend, "wide", run_seed=3, database=None, max_examples=4, passes=("short",)
    )
    assert result.passed, result.difference
    assert backend.widths and min(backend.widths) >= WIDTH


@given(
    st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=5), min_size=1, max_size=4),
    st.integers(1, 8),
)
def test_padding_keeps_each_row_and_pads_with_the_padding_entry(
    rows: list[list[int]], width: int
) -> None:
    padded = pad_tables(tuple(tuple(r) for r in rows), width)
    for row, out in zip(rows, padded, strict=True):
        assert out[: len(row)] == tuple(row)
        assert len(out) == max(width, len(row))
        assert set(out[len(row) :]) <= {PAD_BLOCK}


@pytest.mark.parametrize("bad", [0, -3])
def test_a_bad_table_width_is_refused_by_name(bad: int) -> None:
    with pytest.raises((InvalidRequestError, ValueError, TypeError), match="table_width"):
        Capabilities(name="x", table_width=bad)
