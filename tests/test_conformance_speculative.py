"""The suite's speculative rules: the lockstep's draft / verify / rollback, the plan's limit,
and the scheduler suite's speculative invariants (planted bugs caught)."""

from __future__ import annotations

import pytest

from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.lockstep.plan import MAX_DRAFT, plan_for
from conformance.lockstep.workload import WorkloadConfig, geometry_for, scale_for
from conformance.planted.schedulers import SpecBudgetOneToken, SpecKeepsRejected
from conformance.planted.speculative import LookaheadOneToken
from conformance.scheduler.invariants import run_checked
from conformance.scheduler.rules import (
    ACCEPTANCE,
    BUDGET,
    DRAFTS,
    VERIFIED,
    SchedulerInvariantError,
)
from spec.backend import Capabilities, ReferenceBackend
from spec.errors import ArgumentTypeError, SpeculationError
from spec.request import Request
from spec.scheduler import ContinuousScheduler, SchedulerConfig


def _config(prefix_caching: bool = True) -> WorkloadConfig:
    geometry, heads = geometry_for(4, 2, 2, 8, "float32", 2)
    return WorkloadConfig(geometry, heads, scale_for(8, False), 3, prefix_caching)


def test_lockstep_drafts_verifies_and_rolls_back_on_a_correct_backend() -> None:
    ls = Lockstep(NumpyPagedBackend(), _config())
    ls.add(0, [1, 2, 3, 4, 5])
    ls.step([(0, [1, 2, 3, 4, 5])])
    assert ls.step([(0, [6, 7, 8, 9])], drafts={0: 3}) == [0]
    ls.verify(0, 2)
    assert ls.manager.num_tokens(0) == 8 and ls.manager.num_drafts(0) == 0
    ls.step([(0, [1, 2])], drafts={0: 1})
    ls.rollback(0)
    ls.step([(0, [3])])
    ls.finish()
    assert "ls.step([(0, [6, 7, 8, 9])], drafts={0: 3})" in ls.log
    assert "ls.verify(0, 2)" in ls.log and "ls.rollback(0)" in ls.log
    assert ls.checks["speculative memory rules checked (lookahead blocks, unhashed drafts)"] == 4


def test_lockstep_refuses_bad_speculation_and_changes_nothing() -> None:
    ls = Lockstep(ReferenceBackend(), _config())
    ls.add(0, [1, 2, 3])
    ls.step([(0, [1, 2, 3])])
    with pytest.raises(SpeculationError, match="no drafts in flight"):
        ls.verify(0, 0)
    ls.step([(0, [4, 5, 6])], drafts={0: 2})
    with pytest.raises(SpeculationError, match="drafts in flight"):
        ls.fork(0, 1)
    ls.verify(0, 2)
    assert ls.manager.num_tokens(0) == 6


def test_a_planted_block_manager_is_caught_as_a_memory_difference() -> None:
    ls = Lockstep(LookaheadOneToken(), _config())
    ls.add(0, [1, 2, 3])
    ls.step([(0, [1, 2, 3])])
    with pytest.raises(ConformanceFailure) as caught:
        ls.step([(0, [4, 5, 6])], drafts={0: 2})  # p3..p5: across the boundary
    assert caught.value.difference.what == "memory"
    assert "lookahead slots past a block boundary" in caught.value.difference.detail


@pytest.mark.parametrize(
    ("caps", "draft"),
    [
        (Capabilities("a"), MAX_DRAFT),
        (Capabilities("b", max_query_len=3), 2),
        (Capabilities("c", max_query_len=1), 0),
        (Capabilities("d", speculative=False), 0),
        (Capabilities("e", chunked_prefill=False), 0),
    ],
)
def test_the_plan_drafts_what_the_capabilities_allow(caps: Capabilities, draft: int) -> None:
    plan = plan_for(caps)
    assert plan.max_draft == draft
    assert any(s.startswith("speculative rules") for s in plan.skipped) == (draft == 0)


def test_capabilities_speculative_must_be_a_bool() -> None:
    with pytest.raises(ArgumentTypeError, match="speculative"):
        Capabilities("x", speculative="yes")  # type: ignore[arg-type]


def _requests() -> list[Request]:
    return [Request(request_id=i, prompt=(1, 2, 3), max_new_tokens=8) for i in range(2)]


def test_the_scheduler_suite_checks_speculative_rows_on_the_spec_scheduler() -> None:
    config = SchedulerConfig(
        num_blocks=16, block_size=2, max_num_batched_tokens=8, num_speculative_tokens=3
    )
    report = run_checked(ContinuousScheduler, config, _requests())
    assert report.paths["speculative rows"] > 0 and report.paths["drafts rejected"] > 0
    assert report.checks[DRAFTS] > 0 and report.checks[VERIFIED] > 0
    assert report.checks[ACCEPTANCE] == 1


@pytest.mark.parametrize(
    ("make", "rule"), [(SpecBudgetOneToken, BUDGET), (SpecKeepsRejected, ACCEPTANCE)]
)
def test_the_planted_speculative_schedulers_are_caught(make: type, rule: str) -> None:
    config = SchedulerConfig(
        num_blocks=16, block_size=2, max_num_batched_tokens=4, num_speculative_tokens=3
    )
    with pytest.raises(SchedulerInvariantError) as caught:
        run_checked(make, config, _requests())
    assert caught.value.rule == rule
