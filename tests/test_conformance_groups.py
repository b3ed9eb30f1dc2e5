"""The suite drives KV cache groups: a full-attention and a sliding-window group over one pool.

A backend that declares ``kv_groups`` gets a groups pass: layers in two
groups, memory through the spec's ``CacheManager`` (a window releases blocks
within a few steps; forks, prefix hits and resent prompts on top), each
layer written through its group's slots and compared against the reference
run over its group's tables. Correct backends pass; each planted group bug
is caught; the report says what the groups pass reached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.lockstep.configs import configs
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.group_memory import GroupMemory
from conformance.lockstep.groups import GROUPS, WINDOW_BLOCKS, group_label
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.lockstep.plan import plan_for
from conformance.lockstep.workload import WorkloadConfig
from conformance.planted.backends import PLANTED
from conformance.planted.groups import PLANTED_GROUPS, DropsReleasedEntries, ReadsGroupZeroTables
from conformance.reports.report import text_report
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.attention import PLAIN, VARIANTS, AttentionVariant
from spec.backend import Backend, ReferenceBackend
from spec.batch import PAD_BLOCK
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry


def _torch() -> Backend:
    from backend_gpu.torch_backend import TorchBackend

    return TorchBackend()


def _triton() -> Backend:
    from backend_gpu.triton_backend import TritonBackend

    return TritonBackend()


class _SmallShapes:
    """``inner`` with its capabilities narrowed to small shapes: the Triton interpreter is slow."""

    def __init__(self, inner: Backend) -> None:
        self._inner = inner

    @property
    def capabilities(self) -> Capabilities:
        return replace(
            self._inner.capabilities,
            block_sizes=frozenset({3, 4}),
            head_dims=frozenset({8, 16}),
            gqa_ratios=frozenset({1, 2}),
        )

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def _groups(backend: Backend, name: str, seed: int, examples: int | None = None) -> RunResult:
    """The groups pass alone: the quick profile's 3 examples, or about ``examples``."""
    scaled = None if examples is None else examples * 20  # the short pass's 60 : the groups' 3
    return run_suite(
        backend,
        name,
        run_seed=seed,
        database=None,
        shrink=False,
        passes=["groups"],
        max_examples=scaled,
    )


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["reference", "numpy"])
def test_cpu_backends_conform_with_groups(name: str, seed: int) -> None:
    backend = ReferenceBackend() if name == "reference" else NumpyPagedBackend()
    result = _groups(backend, name, seed)
    assert result.passed, result.difference and result.difference.describe()
    assert result.passes == [("groups", 3)]
    cov = result.stats.coverage
    assert cov.group_examples >= 3 and cov.released_entries > 0 and cov.released_rows > 0
    assert result.stats.checks["batch metadata of KV cache groups validated"] > 0
    assert result.stats.rules["fork (of a sequence whose window released blocks)"] > 0


@pytest.mark.parametrize("make", [_torch, _triton], ids=["torch", "triton"])
def test_torch_and_triton_backends_conform_with_groups(make: Callable[[], Backend]) -> None:
    backend = make()
    assert backend.capabilities.kv_groups and "window" in backend.capabilities.variants
    small: Backend = _SmallShapes(backend)  # type: ignore[assignment]
    result = _groups(small, backend.capabilities.name, seed=1, examples=2)
    assert result.passed, result.difference and result.difference.describe()
    assert result.passes == [("groups", 2)]
    assert result.stats.coverage.released_entries > 0


@pytest.mark.parametrize("name", sorted(PLANTED_GROUPS))
def test_each_planted_group_bug_is_caught(name: str) -> None:
    cls = PLANTED_GROUPS[name]
    assert PLANTED[name] is cls  # registered, so the self-test runs it
    result = _groups(cls(), cls.__name__, seed=1)
    assert result.difference is not None, f"{cls.__name__} was not caught"
    assert result.difference.what in ("K", "V", "output"), result.difference.describe()
    assert result.difference.layer is not None
    assert result.nondeterminism is None and "did not run" not in result.shrink_note  # replays


def test_the_report_says_what_the_groups_pass_reached() -> None:
    result = _groups(ReferenceBackend(), "reference", seed=2)
    report = text_report(result)
    assert "KV cache groups: " in report and "table entries released" in report
    groups = result.stats.coverage.to_json()["kv_groups"]
    assert groups["examples"] >= 3 and groups["released_entries"] > 0
    assert any(" groups " in shape for shape in result.stats.configs)


def test_a_backend_without_groups_gets_no_groups_pass_and_is_told() -> None:
    plan = plan_for(Capabilities("plain"))
    assert "groups" not in [p.kind for p in plan.passes()]
    assert any("capabilities.kv_groups is False" in why for why in plan.skipped)
    without_window = plan_for(Capabilities("g", kv_groups=True))
    assert any("two full-attention groups" in why for why in without_window.skipped)


@settings(max_examples=60, deadline=None)
@given(window=st.booleans(), data=st.data())
def test_group_draws_use_every_group_and_each_windowed_layer_sees_its_window(
    window: bool, data: st.DataObject
) -> None:
    caps = Capabilities("g", kv_groups=True, variants=frozenset(VARIANTS if window else ()))
    plan = next(p for p in plan_for(caps).passes() if p.kind == "groups")
    config: WorkloadConfig = data.draw(configs(plan))
    g, b = config.geometry, config.geometry.block_size
    assert g.num_groups == GROUPS == len(config.group_windows)
    assert config.group_windows[0] is None
    w = config.group_windows[1]
    assert (w is not None) == window
    if w is not None:
        assert max(1, b * min(WINDOW_BLOCKS) - 1) <= w <= b * max(WINDOW_BLOCKS) + 1
        windowed = [x for x in range(g.num_layers) if g.group_of(x) == 1]
        assert windowed and all(config.variant(x).window == w for x in windowed)
    assert group_label(config).startswith(" groups ")


def test_a_windowed_layer_that_would_see_past_its_groups_window_is_refused() -> None:
    g = KVGeometry(2, 8, 4, 1, 8, layer_groups=(0, 1))
    with pytest.raises(ValueError, match="window of 4 tokens, but its attention window is 5"):
        WorkloadConfig(g, 1, 0.3, 0, variants=(PLAIN, AttentionVariant(5)), group_windows=(None, 4))
    with pytest.raises(ValueError, match="1 group windows for 2 KV cache groups"):
        WorkloadConfig(g, 1, 0.3, 0, group_windows=(None,))


def _windowed_config() -> WorkloadConfig:
    g = KVGeometry(2, 16, 2, 1, 8, layer_groups=(0, 1))
    return WorkloadConfig(
        g, 2, 0.35, 1, variants=(PLAIN, AttentionVariant(2)), group_windows=(None, 2)
    )


def test_a_failed_growth_changes_nothing_in_any_group() -> None:
    ls = Lockstep(ReferenceBackend(), _windowed_config())
    ls.add(0, list(range(9)))
    assert ls.step([(0, list(range(9)))]) == [0]
    before = [m.block_table(0) for m in ls.groups.managers] if ls.groups else []
    ls.add(1, list(range(40, 60)))  # 10 blocks in each group: more than the pool has left
    assert ls.step([(1, list(range(40, 60)))]) == []
    assert ls.checks["failed allocations left every KV cache group unchanged"] == 1
    assert ls.groups is not None and [m.block_table(0) for m in ls.groups.managers] == before
    ls.check_integrity()
    ls.finish()


def test_released_entries_have_no_owner_and_a_planted_reader_of_them_fails() -> None:
    config = _windowed_config()

    def workload(ls: Lockstep) -> None:
        ls.add(0, list(range(6)))
        ls.step([(0, list(range(6)))])
        for token in range(3):
            ls.step([(0, [token])])

    ls = Lockstep(ReferenceBackend(), config)
    workload(ls)
    memory = ls.groups
    assert isinstance(memory, GroupMemory)
    table, start = memory.held(1, 0)
    assert table[0] == PAD_BLOCK and start > 0
    b = config.geometry.block_size
    assert set(memory.owners(1).values()) == {(0, p) for p in range(start, 9)}
    assert not any(slot // b == table[0] for slot in memory.owners(1))
    with pytest.raises(ConformanceFailure) as caught:
        workload(Lockstep(DropsReleasedEntries(), replace(config)))
    assert caught.value.difference.layer == 1


class _FullGroupsOnly(NumpyPagedBackend):
    """The numpy backend without attention variants: its groups pass draws two full groups."""

    @property
    def capabilities(self) -> Capabilities:
        return replace(super().capabilities, variants=frozenset())


class _FullGroupsGroupZero(_FullGroupsOnly, ReadsGroupZeroTables):
    """Reads group 0's tables for every layer, without a window to release anything."""


def test_two_full_attention_groups_tell_a_reader_of_the_wrong_table() -> None:
    result = _groups(_FullGroupsOnly(), "full-groups", seed=3)
    assert result.passed, result.difference and result.difference.describe()
    assert all("full/full" in shape for shape in result.stats.configs)
    assert result.stats.coverage.released_entries == 0
    assert _groups(_FullGroupsGroupZero(), "group-zero", seed=3).difference is not None
