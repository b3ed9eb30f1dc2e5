"""Every real failure in one run: a failing pass is drawn again without the failure's cause.

A kernel with two independent bugs (its fp8 KV write truncates; its ALiBi bias
is measured from key 0, which only a sink shows) gets both reported from one
run, grouped by cause, and the margins line shows no excess its failures do
not list. A backend that excludes a pairing the feature passes open with
(ALiBi with sinks, as vLLM's kernel must) passes, with the pairing reported as
excluded; a pass with nothing left to draw is skipped, and only a run in which
no pass can draw is a setup error.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from conformance.errors import SetupError
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.planted.variants import AlibiFromKeyZero, Fp8Truncates
from conformance.reports.report import text_report
from conformance.run.control import RunControl
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.attention import AttentionVariant
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry


class TwoBugs(Fp8Truncates, AlibiFromKeyZero):
    """Both planted bugs at once: independent, each in its own part of the kernel."""


def _no_alibi_with_sinks(g: KVGeometry, h: int, v: AttentionVariant | None) -> str | None:
    if v is not None and {"alibi", "sinks"} <= v.features:
        return "ALiBi with sinks (its bias is slope * (k - context_len))"
    return None


class NoAlibiWithSinks(NumpyPagedBackend):
    """A correct backend that cannot run ALiBi together with sinks, and says so."""

    @property
    def capabilities(self) -> Capabilities:
        return replace(super().capabilities, excludes=_no_alibi_with_sinks)


class NoSinks(NumpyPagedBackend):
    """Declares sinks (and no other variant), then vetoes them: its feature pass draws nothing."""

    @property
    def capabilities(self) -> Capabilities:
        def veto(g: KVGeometry, h: int, v: AttentionVariant | None) -> str | None:
            return "sinks, after all" if v is not None and "sinks" in v.features else None

        caps = super().capabilities
        sinks = frozenset({"sinks"})
        return replace(caps, variants=sinks, kv_dtypes=frozenset(), kv_groups=False, excludes=veto)


@pytest.fixture(scope="module")
def two_bugs() -> RunResult:
    control = RunControl(shrink=False)
    return run_suite(
        TwoBugs(), "two bugs", run_seed=1, database=None, control=control,
        max_examples=2, passes=("feature",),
    )  # fmt: skip


def test_both_independent_bugs_are_reported_from_one_run(two_bugs: RunResult) -> None:
    causes = {f.cause for f in two_bugs.failures}
    # the write bug: isolated by replaying without the fp8 cache (it passes unquantized)
    assert any(c and c.startswith("KV dtype fp8_") and "passes without it" in c for c in causes)
    # the ALiBi origin: named, because that recomputation reproduces the outputs
    assert "the ALiBi origin" in causes, causes
    assert all(f.isolated for f in two_bugs.failures)
    text = text_report(two_bugs)
    assert "cause: the ALiBi origin" in text and "cause: KV dtype fp8_" in text
    assert any(", without " in name for name, _ in two_bugs.passes)


def test_no_margin_shows_an_excess_its_failures_do_not_list(two_bugs: RunResult) -> None:
    listed: dict[str, float] = {}
    for f in two_bugs.failures:
        n = f.difference.numerics
        if n is not None:
            listed[n.dtype] = max(listed.get(n.dtype, 0.0), n.excess)
    for dtype, excess in two_bugs.stats.margins.step.items():
        if excess > 1.0:
            assert listed.get(dtype) == excess, (dtype, excess, listed)


def test_a_backend_that_excludes_alibi_with_sinks_passes_with_the_pairing_reported() -> None:
    for examples in (2, None):  # the constructed openings, and a whole quick run
        result = run_suite(NoAlibiWithSinks(), "x", run_seed=1, database=None,
                           max_examples=examples)  # fmt: skip
        assert result.passed, result.difference
        assert any(name.startswith("feature (alibi)") for name, _ in result.passes)
        excluded = [s for s in result.skipped if s.startswith("attention variant alibi+sinks")]
        assert len(excluded) == 2 and "draws alibi without it" in excluded[0], excluded


def test_a_pass_with_nothing_to_draw_is_skipped_and_only_no_pass_at_all_is_a_setup_error() -> None:
    run: dict[str, Any] = {"run_seed": 1, "database": None, "max_examples": 2}
    result = run_suite(NoSinks(), "no sinks", passes=("short", "feature"), **run)
    assert result.passed, result.difference
    nothing = [s for s in result.skipped if "nothing to draw" in s]
    assert nothing == ["pass feature (sinks): nothing to draw: the backend's excludes vetoes "
                       "sinks on every shape"], result.skipped  # fmt: skip
    with pytest.raises(SetupError, match=r"could not draw one workload .* in any pass"):
        run_suite(NoSinks(), "no sinks", passes=("feature",), **run)
