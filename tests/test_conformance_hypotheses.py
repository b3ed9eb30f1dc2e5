"""A wrong output is named by the mistake that reproduces it, in the report's first five lines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.judges.hypotheses import HYPOTHESES, Case, Mistake, attend_with, diagnose
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.planted.backends import ReadsPastSeqLen, WrongGqaMapping
from conformance.planted.variants import CausalOffByOne
from conformance.reports.report import text_report
from conformance.run.runner import run_suite
from spec.attention import PLAIN, AttentionVariant, attend


@pytest.mark.parametrize(
    ("backend", "named"),
    [
        (WrongGqaMapping, "matches attention with KV head h % H_kv: the GQA head mapping"),
        (CausalOffByOne, "also sees key p + 1: the causal mask off by one"),
        (ReadsPastSeqLen, "stale KV of the block's previous owner read as keys"),
    ],
)
def test_report_names_the_planted_mistake_in_its_first_five_lines(
    backend: type[NumpyPagedBackend], named: str
) -> None:
    result = run_suite(backend(), "planted", run_seed=1, database=None, shrink=False,
                       passes=["short"])  # fmt: skip
    head = text_report(result).splitlines()[:5]
    assert result.difference is not None
    assert any("first difference: output differs" in line for line in head), head
    assert any(named in line for line in head), head


def _case(seed: int, heads: int, kv_heads: int, n: int, variant: AttentionVariant) -> Case:
    """``n`` queries over their own ``n`` keys, and two stale slots after them in the block."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n + 2, kv_heads, 8))
    v = rng.standard_normal((n + 2, kv_heads, 8))
    q = rng.standard_normal((n, heads, 8))
    pos = np.arange(n)
    whole = [(k, v, pos, 0)]
    return Case(q, [(k[:n], v[:n], pos, 0)], 0.7, variant, (1.0, 1.0), whole=whole)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from([(4, 2), (6, 2), (8, 4)]), st.integers(3, 9))
def test_the_unmistaken_recomputation_is_the_spec(
    seed: int, heads: tuple[int, int], n: int
) -> None:
    """``Mistake()`` computes what the spec's reference does, for every variant."""
    h, kv = heads
    variant = AttentionVariant(
        window=3, softcap=2.0, sinks=tuple(0.1 * i for i in range(h)),
        alibi_slopes=tuple(0.05 * (i + 1) for i in range(h)),
    )  # fmt: skip
    for v in (PLAIN, variant):
        case = _case(seed, h, kv, n, v)
        k, val, pos, _ = case.keys[0]
        want = attend(case.query, k, val, pos, case.scale, v)
        got = attend_with(case, Mistake())
        assert got is not None
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(range(len(HYPOTHESES))))
def test_each_mistake_that_changes_the_output_is_named(seed: int, which: int) -> None:
    """An output computed with one named mistake is diagnosed as that mistake (or one that
    computes the same output)."""
    variant = AttentionVariant(
        window=4, softcap=1.5, sinks=(0.5, 1.0, 1.5, 2.0), alibi_slopes=(0.3, 0.2, 0.1, 0.05)
    )
    case = _case(seed, 4, 2, 7, variant)
    name, mistake = HYPOTHESES[which]
    wrong = attend_with(case, mistake)
    exact = attend_with(case, Mistake())
    assert exact is not None
    if wrong is None or not np.isfinite(wrong).all() or np.abs(wrong - exact).max() < 1e-9:
        return  # not applicable to this case (a shifted row needs two sequences, say)
    found = diagnose(case, exact, wrong)
    assert found is not None
    same = [n for n, m in HYPOTHESES if (o := attend_with(case, m)) is not None
            and np.isfinite(o).all() and np.abs(o - wrong).max() == 0.0]  # fmt: skip
    assert any(found.startswith(f"matches {n}") for n in same), (name, found)


def test_no_mistake_is_named_for_noise() -> None:
    case = _case(3, 4, 2, 6, PLAIN)
    exact = attend_with(case, Mistake())
    assert exact is not None
    noisy = exact + np.random.default_rng(0).standard_normal(exact.shape) * 1e-3
    assert diagnose(case, exact, noisy) is None
