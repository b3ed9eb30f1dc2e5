"""Declared product precision: a kernel that rounds its products on purpose says so, and is
judged beside a reference that rounds them the same way.

Undeclared, a kernel that rounds each ``q.k`` product to float16 (as SGLang's fp16 decode
kernel does) fails, and the report names that rounding; declared
(``products="activation"``), it passes. A declaration the suite does not know, or one that
contradicts the declared dtypes, is refused naming it: a setup error of the run.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.cli import main
from conformance.judges.numerics import same_precision
from conformance.planted.backends import ProductsInActivationDtype
from conformance.reports.report import text_report
from conformance.run.runner import run_suite
from spec.attention import attend
from spec.attention_batched import attend_at_precision
from spec.capabilities import PRODUCTS, Capabilities
from spec.errors import ArgumentValueError


class DeclaresActivationProducts(ProductsInActivationDtype):
    """The same kernel, saying what it does."""

    @property
    def capabilities(self) -> Capabilities:
        return replace(super().capabilities, products="activation")


def test_undeclared_rounded_products_fail_with_the_rounding_named() -> None:
    result = run_suite(ProductsInActivationDtype(), "p", run_seed=7, database=None,
                       max_examples=8, passes=("short",), shrink=False)  # fmt: skip
    assert not result.passed
    first_lines = "\n".join(text_report(result).splitlines()[:3])
    assert "q.k products rounded to the activation dtype" in first_lines, first_lines


def test_declared_rounded_products_pass_and_the_report_says_so() -> None:
    result = run_suite(DeclaresActivationProducts(), "p", run_seed=7, database=None,
                       max_examples=8, passes=("short",))  # fmt: skip
    assert result.passed, result.difference
    assert "the backend declares 'activation'" in text_report(result)


@given(products=st.sampled_from(PRODUCTS), dtype=st.sampled_from(["float16", "bfloat16"]))
def test_exact_products_change_nothing_and_the_others_round_as_named(
    products: str, dtype: str
) -> None:
    """The same-precision reference of each declaration, against the definition: exact and fp8
    (on an unquantized cache) are the honest kernel's; tf32 changes nothing in half precision;
    activation moves the outputs by the products' rounding, normalised by the probabilities'
    (rounded after the division by their sum, not before)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((n, 1, 16)) for n in (4, 32, 32))
    pos = np.arange(28, 32)
    honest = attend_at_precision(q, k, v, pos, 0.5, precision=same_precision(dtype, False))
    declared = same_precision(dtype, False, products, kv_dtype=None)
    got = attend_at_precision(q, k, v, pos, 0.5, precision=declared)
    if products in ("activation", "normalised"):
        assert not np.array_equal(got, honest)
        assert np.abs(got - attend(q, k, v, pos, 0.5)).max() < 0.1
    else:
        assert np.array_equal(got, honest)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"products": "fast"}, "capabilities.products"),
        ({"products": "tf32", "dtypes": {"float16"}}, "float32 is not among the dtypes"),
        ({"products": "activation", "dtypes": {"float32"}}, "no such dtype is declared"),
        ({"products": "fp8"}, "no kv_dtypes are declared"),
    ],
)
def test_an_unknown_or_contradicting_declaration_is_refused(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ArgumentValueError, match=message):
        Capabilities("x", **fields)  # type: ignore[arg-type]


class DeclaresTf32WithoutFloat32(ProductsInActivationDtype):
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities("x", dtypes={"float16"}, products="tf32")


def test_a_contradicting_declaration_is_a_setup_error_of_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ref = "tests/test_conformance_products.py:DeclaresTf32WithoutFloat32"
    assert main(["run", "--backend", ref, "--in-process", "--no-database"]) == 2
    assert "capabilities.products='tf32'" in capsys.readouterr().err
