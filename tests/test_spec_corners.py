"""The spec's corners: overflowed scores, the last raw exceptions, bools as ids, a clock that lies.

Each case used to return something silently wrong (NaN outputs, negative
latencies, ``False in`` a manager being True) or raise a raw Python exception
(``AttributeError``, ``OverflowError``); each now raises a specific
:class:`~spec.errors.SpecError` that names the argument, and changes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.attention import AttentionVariant, paged_attention
from spec.batch import BatchMetadata, build_batch
from spec.block_manager import BlockManager
from spec.errors import ArgumentTypeError, ArgumentValueError, InvalidBatchError, SpecError
from spec.kv_groups import StateManager, StatePool
from spec.kv_memory import KVMemory
from spec.metrics import MetricsRecorder

T, V = ArgumentTypeError, ArgumentValueError


def _step() -> tuple[BlockManager, BatchMetadata, KVMemory]:
    """Sequence 0, three tokens, all new; K all ones, V 0..5 (so NaN or a wrong mix shows)."""
    m = BlockManager(num_blocks=4, block_size=2)
    m.add_sequence(0, [1, 2, 3])
    slots = m.append_slots(0, [1, 2, 3])
    mem = KVMemory(1, 4, 2, 1, 2)
    mem.write(0, np.ones((3, 1, 2)), np.arange(6.0).reshape(3, 1, 2), slots)
    return m, build_batch(m, [(0, 3)]), mem


def _memory_state(mem: KVMemory) -> tuple[np.ndarray, np.ndarray]:
    return mem.k[0].copy(), mem.v[0].copy()


# -- attention scores that overflow float64 --------------------------------------------------

OVERFLOWS: list[tuple[str, float, np.ndarray, AttentionVariant | None]] = [
    ("a huge scale, scores -inf", 1e308, -np.ones((3, 1, 2)), None),
    ("a huge scale, scores +inf", 1e308, np.ones((3, 1, 2)), None),
    ("a huge ALiBi slope", 0.5, np.ones((3, 1, 2)), AttentionVariant(alibi_slopes=(1e308,))),
    ("a huge negative slope", 0.5, np.ones((3, 1, 2)), AttentionVariant(alibi_slopes=(-1e308,))),
    ("huge query values", 1.0, np.full((3, 1, 2), 1e308), None),
]


@pytest.mark.parametrize(("case", "scale", "query", "variant"), OVERFLOWS, ids=lambda x: str(x))
def test_overflowed_scores_are_refused(
    case: str, scale: float, query: np.ndarray, variant: AttentionVariant | None
) -> None:
    _, batch, mem = _step()
    with pytest.raises(ArgumentValueError, match="attention scores overflow float64") as raised:
        paged_attention(query, batch, mem, 0, scale, variant=variant)
    assert "scale" in str(raised.value)
    if variant is not None:
        assert "ALiBi slope" in str(raised.value)


def test_a_huge_scale_under_a_softcap_is_finite_and_right() -> None:
    """Soft-capping bounds every score: ``c * tanh(inf) = c``, the limit, not an overflow."""
    _, batch, mem = _step()
    capped = AttentionVariant(softcap=2.0)
    out = paged_attention(-np.ones((3, 1, 2)), batch, mem, 0, 1e308, variant=capped)
    plain = paged_attention(np.zeros((3, 1, 2)), batch, mem, 0, 1.0)  # every score equal
    assert np.isfinite(out).all() and np.allclose(out, plain)


def test_nan_from_unwritten_memory_still_flows_through() -> None:
    """A read of a slot nobody wrote is NaN by design: that is not an overflow."""
    m = BlockManager(num_blocks=4, block_size=2)
    m.add_sequence(0, [1, 2])
    m.append_slots(0, [1, 2])
    batch, mem = build_batch(m, [(0, 2)]), KVMemory(1, 4, 2, 1, 2)  # nothing written
    assert np.isnan(paged_attention(np.ones((2, 1, 2)), batch, mem, 0, 1e308)).all()


@settings(max_examples=40)
@given(exponent=st.integers(0, 308), sign=st.sampled_from([1.0, -1.0]))
def test_any_scale_gives_finite_outputs_or_a_clear_error(exponent: int, sign: float) -> None:
    """The invariant: finite inputs give finite outputs, or the call is refused; never NaN."""
    _, batch, mem = _step()
    query = sign * np.array([[[1.0, 0.5]], [[0.25, -1.0]], [[-2.0, 1.0]]])
    try:
        out = paged_attention(query, batch, mem, 0, 10.0**exponent)
    except ArgumentValueError as error:
        assert "overflow" in str(error)
    else:
        assert np.isfinite(out).all()


# -- the remaining raw exceptions -------------------------------------------------------------

_M, _BATCH, _MEM = _step()
_Q = np.ones((3, 1, 2))
RAW: dict[str, tuple[Callable[[], object], type[SpecError], str]] = {
    "build_batch(None)": (lambda: build_batch(None, [(0, 3)]), T, "manager"),  # type: ignore[arg-type]
    "build_batch(m, None)": (lambda: build_batch(_M, None), T, "scheduled"),  # type: ignore[arg-type]
    "build_batch(m, [(0,)])": (lambda: build_batch(_M, [(0,)]), T, "scheduled[0]"),  # type: ignore[list-item]
    "build_batch(m, groups=[None])": (
        lambda: build_batch(_M, [(0, 3)], groups=[None]),  # type: ignore[list-item]
        T,
        "groups[0]",
    ),
    "a slot of 2**70": (
        lambda: _MEM.write(0, np.ones((1, 1, 2)), np.ones((1, 1, 2)), [2**70]),
        V,
        "slot_mapping[0]",
    ),
    "a slot of True": (
        lambda: _MEM.write(0, np.ones((1, 1, 2)), np.ones((1, 1, 2)), [True]),
        T,
        "slot_mapping[0]",
    ),
    "a slot of 1.7": (
        lambda: _MEM.write(0, np.ones((1, 1, 2)), np.ones((1, 1, 2)), [1.7]),  # type: ignore[list-item]
        T,
        "slot_mapping[0]",
    ),
    "a slot written twice": (
        lambda: _MEM.write(0, np.ones((2, 1, 2)), np.ones((2, 1, 2)), [6, 6]),
        V,
        "slot_mapping",
    ),
    "a list as query": (lambda: paged_attention(_Q.tolist(), _BATCH, _MEM, 0), T, "query"),  # type: ignore[arg-type]
    "an int query": (lambda: paged_attention(_Q.astype(int), _BATCH, _MEM, 0), T, "query"),
    "a string as variant": (
        lambda: paged_attention(_Q, _BATCH, _MEM, 0, variant="window"),  # type: ignore[arg-type]
        T,
        "variant",
    ),
    "None as batch": (lambda: paged_attention(_Q, None, _MEM, 0), T, "batch"),  # type: ignore[arg-type]
    "None as memory": (lambda: paged_attention(_Q, _BATCH, None, 0), T, "memory"),  # type: ignore[arg-type]
    "a string as group": (lambda: paged_attention(_Q, _BATCH, _MEM, 0, group="0"), T, "group"),  # type: ignore[arg-type]
    "a bool as layer": (lambda: paged_attention(_Q, _BATCH, _MEM, True), T, "layer"),
}


@pytest.mark.parametrize("case", list(RAW))
def test_raw_exceptions_became_specific_errors(case: str) -> None:
    call, error, name = RAW[case]
    k, v = _memory_state(_MEM)
    copies = _M.pending_copies()
    with pytest.raises(error) as raised:
        call()
    assert str(raised.value).startswith(name), str(raised.value)
    assert np.array_equal(_MEM.k[0], k, equal_nan=True)
    assert np.array_equal(_MEM.v[0], v, equal_nan=True)
    assert _M.pending_copies() == copies and _M.block_table(0) == _BATCH.block_tables[0]


def test_gather_never_converts_table_entries_it_does_not_read() -> None:
    """A table entry past the tokens may be anything >= -1: 2**70 there is not an overflow."""
    _, _, mem = _step()
    keys, _ = mem.gather(0, [0, 1, 2**70], num_tokens=3)
    assert keys.shape == (3, 1, 2)


@pytest.mark.parametrize(
    "field",
    ["query_start_loc", "seq_lens", "positions", "slot_mapping"],
)
@pytest.mark.parametrize("bad", [True, 1.0, "1"])
def test_batch_validate_refuses_entries_that_are_not_ints(field: str, bad: object) -> None:
    _, batch, _ = _step()
    values = list(getattr(batch, field))
    values[-1] = bad
    broken = dataclasses.replace(batch, **{field: tuple(values)})  # type: ignore[arg-type]
    with pytest.raises(InvalidBatchError, match=rf"{field}\[\d\] must be an int"):
        broken.validate(4)


# -- bools are never ids ------------------------------------------------------------------------


def test_false_is_not_in_a_state_manager() -> None:
    states = StateManager(StatePool(3))
    states.add(0)
    states.add(1)
    assert 0 in states and 1 in states and np.int64(1) in states
    for not_an_id in (False, True, np.False_, 0.0, "0", None):
        assert not_an_id not in states, not_an_id


def test_false_is_not_in_a_block_manager() -> None:
    m, _, _ = _step()
    assert 0 in m and False not in m and 0.0 not in m


# -- summarize: a clock that runs forward ------------------------------------------------------


def _recorder(arrival_time: float | None = None) -> MetricsRecorder:
    m = MetricsRecorder()
    m.on_submit(7, "chat", step=0, arrival_time=arrival_time)
    m.on_scheduled(7, step=0)
    for s in (0, 1, 2):
        m.on_token(7, sample=0, step=s)
    m.on_finish(7, step=2)
    return m


BAD_CLOCKS: list[tuple[object, type[SpecError], str]] = [
    ([3.0, 2.0, 1.0], V, "step_end_times[1] is 2.0, before step_end_times[0] = 3.0"),
    ([0.5, math.nan, 1.5], V, "step_end_times[1] must be finite, got nan"),
    ([0.5, 1.0, math.inf], V, "step_end_times[2] must be finite"),
    ([-1.0, 0.0, 1.0], V, "step_end_times[0] must be >= 0.0"),
    ([0.5, 1.0], V, "step_end_times has 2 entries, but request 7 finished in step 2"),
    ([0.5, True, 2.0], T, "step_end_times[1] must be a real number"),
    ("abc", T, "step_end_times must be a sequence"),
    (np.array([[1.0, 2.0, 3.0]]), T, "step_end_times must be a sequence"),
]


@pytest.mark.parametrize(("ends", "error", "message"), BAD_CLOCKS, ids=repr)
def test_summarize_refuses_a_clock_that_is_unordered_or_not_finite(
    ends: object, error: type[SpecError], message: str
) -> None:
    m = _recorder()
    with pytest.raises(error) as raised:
        m.summarize(ends)  # type: ignore[arg-type]
    assert message in str(raised.value)


def test_summarize_refuses_an_arrival_after_its_first_step() -> None:
    with pytest.raises(
        ArgumentValueError, match=r"request 7 arrived at 9\.0, after the end of step 0"
    ):
        _recorder(arrival_time=9.0).summarize([0.5, 1.0, 1.5])


def test_summarize_with_a_good_clock_is_unchanged() -> None:
    (summary,) = _recorder().summarize(np.array([0.5, 1.0, 1.5]))  # type: ignore[arg-type]
    assert (summary.ttft_seconds, summary.itl_seconds) == (0.5, 0.5)
    (no_clock,) = _recorder().summarize([])
    assert no_clock.ttft_seconds is None and no_clock.ttft_steps == 1.0


@settings(max_examples=60)
@given(
    ends=st.lists(
        st.one_of(st.floats(-10, 10), st.sampled_from([math.nan, math.inf, -math.inf])),
        min_size=3,
        max_size=5,
    ),
    arrival=st.one_of(st.none(), st.floats(-10, 10)),
)
def test_summarize_never_reports_a_negative_or_nan_latency(
    ends: list[float], arrival: float | None
) -> None:
    """The invariant: either a clear error, or every latency finite and >= 0."""
    try:
        (s,) = _recorder(arrival).summarize(ends)
    except ArgumentValueError:
        return
    for x in (s.queue_delay_seconds, s.ttft_seconds, s.itl_seconds):
        assert x is not None and math.isfinite(x) and x >= 0, (ends, arrival, s)
