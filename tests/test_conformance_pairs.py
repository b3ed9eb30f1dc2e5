"""Every feature meets every kernel path in a quick run, by construction; the rest say why."""

from __future__ import annotations

from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.lockstep.pairs import PATHS, planned_pairs
from conformance.planted.backends import Int32OffsetsInCachedContext, SinksWrongOnSplitKV
from conformance.run.runner import run_suite
from spec.attention import VARIANTS
from spec.backend import Capabilities

_CONSTRUCTED = ["feature", "large pool", "groups"]


def test_the_constructed_passes_reach_every_reachable_pair() -> None:
    result = run_suite(NumpyPagedBackend(), "numpy", run_seed=5, database=None,
                       passes=_CONSTRUCTED)  # fmt: skip
    assert result.passed
    cov = result.stats.coverage.paths
    missing = [p for p in cov.planned if not cov.pairs[p]]
    assert missing == [p for p in cov.planned if p in cov.unreachable]
    for v in VARIANTS:
        for path in PATHS:
            assert cov.pairs[(v, path)] and cov.pairs[(f"fp8+{v}", path)], (v, path)
    assert cov.pairs[("alibi+sinks", "split-KV decode")]
    assert cov.pairs[("large pool+cached context", "prefill")]
    lines = result.stats.coverage.describe()
    assert any(line.startswith("feature x path pairs reached: ") for line in lines)
    # the numpy backend names no path and launches no kernel: its counts are the plan's, said so
    assert cov.known_by == {"plan": sum(cov.known_by.values())}
    assert any("the suite's plan, not observed" in line for line in lines)


def test_capabilities_that_rule_a_path_out_are_named() -> None:
    caps = Capabilities("x", variants={"sinks"}, mixed_batches=False, max_context_len=200)
    wanted, why = planned_pairs(caps, "cpu")
    assert ("sinks", "mixed") in wanted
    assert "mixed_batches is False" in why[("sinks", "mixed")]
    assert "max_context_len 200" in why[("sinks", "split-KV decode")]
    assert ("sinks", "prefill") not in why


def test_bugs_only_a_constructed_pair_shows_are_caught_there() -> None:
    for cls, where in (
        (SinksWrongOnSplitKV, "feature"),
        (Int32OffsetsInCachedContext, "large pool"),
    ):
        clean = run_suite(cls(), "x", run_seed=5, database=None, shrink=False,
                          passes=["short"])  # fmt: skip
        assert clean.passed, cls
        caught = run_suite(cls(), "x", run_seed=5, database=None, shrink=False, passes=[where])
        assert not caught.passed, cls
