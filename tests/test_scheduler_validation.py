"""Bad input to the scheduler: refused with a specific error naming the argument, changing nothing.

Three layers, each checked here: a :class:`Request` and a
:class:`SchedulerConfig` refuse bad fields when they are made; ``submit``
refuses what could later fail inside a step; ``abort``, ``step``, ``update``
and ``result`` refuse bad calls. After any refused call the scheduler's
public state is exactly what it was (queues and statuses, the block tables,
the pools, the metrics), and the healthy requests still run to the end with
every block returned.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.scheduler.executors import default_tokens, expected_outputs
from conformance.scheduler.workloads import Workload, workloads
from spec.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    CapacityError,
    InvalidRequestError,
    SpecError,
)
from spec.request import Request
from spec.sched_types import SchedulerOutput
from spec.scheduler import ContinuousScheduler, SchedulerConfig, StaticScheduler

# -- Request --------------------------------------------------------------------------

_GOOD_REQUEST: dict[str, Any] = {"request_id": 0, "prompt": (1, 2, 3), "max_new_tokens": 4}

BAD_REQUEST_FIELDS: list[tuple[str, object, type[SpecError]]] = [
    ("request_id", -1, ArgumentValueError),
    ("request_id", "0", ArgumentTypeError),
    ("request_id", True, ArgumentTypeError),
    ("request_id", 0.0, ArgumentTypeError),
    ("prompt", (), ArgumentValueError),
    ("prompt", ("a", "b"), ArgumentTypeError),
    ("prompt", "12", ArgumentTypeError),
    ("prompt", (1, -2), ArgumentValueError),
    ("prompt", (1, 2.0), ArgumentTypeError),
    ("prompt", (1, True), ArgumentTypeError),
    ("prompt", 5, ArgumentTypeError),
    ("prompt", {1, 2}, ArgumentTypeError),
    ("prompt", np.zeros((2, 2), dtype=np.int64), ArgumentTypeError),
    ("max_new_tokens", 0, ArgumentValueError),
    ("max_new_tokens", 2.0, ArgumentTypeError),
    ("max_new_tokens", 1.5, ArgumentTypeError),
    ("max_new_tokens", None, ArgumentTypeError),
    ("n", 0, ArgumentValueError),
    ("n", 1.5, ArgumentTypeError),
    ("n", False, ArgumentTypeError),
    ("priority", "high", ArgumentTypeError),
    ("priority", None, ArgumentTypeError),
    ("priority", math.nan, ArgumentTypeError),
    ("priority", 1.0, ArgumentTypeError),
    ("stop_tokens", 5, ArgumentTypeError),
    ("stop_tokens", "5", ArgumentTypeError),
    ("stop_tokens", {-1}, ArgumentValueError),
    ("stop_tokens", (1, 2.5), ArgumentTypeError),
    ("stop_tokens", frozenset({True}), ArgumentTypeError),
    ("temperature", -0.5, ArgumentValueError),
    ("temperature", math.nan, ArgumentValueError),
    ("temperature", math.inf, ArgumentValueError),
    ("temperature", "0", ArgumentTypeError),
    ("seed", 1.5, ArgumentTypeError),
    ("seed", "1", ArgumentTypeError),
    ("request_class", 5, ArgumentTypeError),
    ("request_class", None, ArgumentTypeError),
    ("arrival_time", math.nan, ArgumentValueError),
    ("arrival_time", "now", ArgumentTypeError),
]


@pytest.mark.parametrize(("name", "value", "error"), BAD_REQUEST_FIELDS)
def test_request_refuses_a_bad_field_and_names_it(
    name: str, value: object, error: type[SpecError]
) -> None:
    with pytest.raises(error) as info:
        Request(**(_GOOD_REQUEST | {name: value}))
    assert name in str(info.value)


def test_request_normalises_what_it_accepts() -> None:
    r = Request(
        request_id=np.int64(3),  # type: ignore[arg-type]
        prompt=np.array([4, 0, 6]),  # type: ignore[arg-type]
        max_new_tokens=np.int32(2),  # type: ignore[arg-type]
        stop_tokens=[np.int64(7), 8],  # type: ignore[arg-type]
        priority=np.int8(-2),  # type: ignore[arg-type]
        temperature=np.float32(0.5),  # type: ignore[arg-type]
        arrival_time=1,
    )
    assert (r.request_id, r.prompt, r.max_new_tokens, r.priority) == (3, (4, 0, 6), 2, -2)
    assert r.stop_tokens == frozenset({7, 8}) and type(r.request_id) is int
    assert all(type(t) is int for t in (*r.prompt, *r.stop_tokens))
    assert (r.temperature, r.arrival_time) == (0.5, 1.0)


# -- SchedulerConfig ----------------------------------------------------------------------

_GOOD_CONFIG: dict[str, Any] = {"num_blocks": 8, "block_size": 4}

BAD_CONFIG_FIELDS: list[tuple[str, object, type[SpecError]]] = [
    ("num_blocks", 0, ArgumentValueError),
    ("num_blocks", 4.0, ArgumentTypeError),
    ("block_size", -4, ArgumentValueError),
    ("block_size", "4", ArgumentTypeError),
    ("max_num_batched_tokens", 0, ArgumentValueError),
    ("max_num_batched_tokens", True, ArgumentTypeError),
    ("max_num_seqs", 0, ArgumentValueError),
    ("max_num_seqs", 2.5, ArgumentTypeError),
    ("max_model_len", 0, ArgumentValueError),
    ("max_model_len", -1, ArgumentValueError),
    ("max_chunk_tokens", 0, ArgumentValueError),
    ("max_chunk_tokens", 8.0, ArgumentTypeError),
    ("policy", "FCFS", ArgumentValueError),
    ("policy", None, ArgumentValueError),
    ("preemption", "swapping", ArgumentValueError),
    ("num_host_blocks", -1, ArgumentValueError),
    ("num_host_blocks", 1.0, ArgumentTypeError),
    ("enable_prefix_caching", "no", ArgumentTypeError),
    ("enable_prefix_caching", 0, ArgumentTypeError),
    ("enable_prefix_caching", None, ArgumentTypeError),
    ("aging_steps", 0, ArgumentValueError),
    ("aging_steps", 10.0, ArgumentTypeError),
]


@pytest.mark.parametrize(("name", "value", "error"), BAD_CONFIG_FIELDS)
def test_config_refuses_a_bad_field_and_names_it(
    name: str, value: object, error: type[SpecError]
) -> None:
    with pytest.raises(error) as info:
        SchedulerConfig(**(_GOOD_CONFIG | {name: value}))
    assert name in str(info.value)


def test_config_normalises_numpy_values() -> None:
    cfg = SchedulerConfig(
        num_blocks=np.int64(8),  # type: ignore[arg-type]
        block_size=np.int32(4),  # type: ignore[arg-type]
        enable_prefix_caching=np.bool_(True),  # type: ignore[arg-type]
    )
    assert type(cfg.num_blocks) is int and cfg.enable_prefix_caching is True
    with pytest.raises(ArgumentTypeError, match="config"):
        ContinuousScheduler({"num_blocks": 8, "block_size": 4})  # type: ignore[arg-type]


# -- invalid calls against a live scheduler -------------------------------------------------


def _snapshot(s: ContinuousScheduler) -> object:
    """The public state: sequences and their statuses, tables, pools, host, metrics, results."""
    m = s.manager
    results = {rid: _finished(s, rid) and s.result(rid) for rid in s.metrics.timelines}
    return (
        [
            (q.seq_id, q.status, q.num_computed, tuple(q.tokens), q.forked, q.preempted)
            for q in s.sequences()
        ],
        s.has_unfinished(),
        {sid: (m.block_table(sid), m.tokens(sid)) for sid in m.sequence_ids()},
        (m.pool.num_free, m.pool.num_cached, m.pool.num_held, m.pool.num_allocation_failures),
        (m.prefix_stats.queried_tokens, m.prefix_stats.hit_tokens),
        {sid: s.cache.host_blocks(sid) for sid in s.cache.swapped_ids()},
        s.host.num_free,
        list(s.metrics.steps),
        copy.deepcopy(s.metrics.timelines),
        results,
    )


@dataclass
class _Live:
    """A scheduler part-way through a workload; ``pending``: between step() and update()."""

    sched: ContinuousScheduler
    workload: Workload
    pending: SchedulerOutput | None
    submitted: list[int]

    def sampled(self) -> dict[int, int]:
        assert self.pending is not None
        reqs = {r.request_id: r for r in self.workload.requests}
        return {
            s.seq_id: default_tokens(reqs[s.request_id], s.sample_index, s.position)
            for s in self.pending.samples
        }


def _advance(w: Workload, cls: Callable[[SchedulerConfig], ContinuousScheduler], steps: int,
             stop_pending: bool) -> _Live:  # fmt: skip
    s = cls(w.config)
    live = _Live(s, w, None, [])
    for r in w.requests:
        s.submit(r)
        live.submitted.append(r.request_id)
    for i in range(steps + 1):
        live.pending = s.step()
        if stop_pending and i == steps:
            return live
        s.update(live.sampled())
        live.pending = None
        if not s.has_unfinished():
            break
    return live


# Each bad call: (name, the call, expected error, a word its message must contain).
BadCall = tuple[str, Callable[[_Live], object], type[SpecError], str]


def _bad_calls(live: _Live) -> list[BadCall]:
    s, w = live.sched, live.workload
    cfg = w.config
    some = w.requests[0]
    calls: list[BadCall] = [
        ("submit a dict", lambda L: s.submit({"request_id": 99}), ArgumentTypeError, "request"),  # type: ignore[arg-type]
        ("submit a duplicate", lambda L: s.submit(some), ArgumentValueError, "request_id"),
        (
            "submit past max_model_len",
            lambda L: s.submit(
                Request(request_id=1000, prompt=(1,) * cfg.max_model_len, max_new_tokens=1)
            ),
            CapacityError,
            "max_model_len",
        ),
        (
            "submit more samples than seats",
            lambda L: s.submit(
                Request(request_id=1001, prompt=(1,), max_new_tokens=1, n=cfg.max_num_seqs + 1)
            ),
            CapacityError,
            "max_num_seqs",
        ),
        ("abort a str id", lambda L: s.abort("0"), ArgumentTypeError, "request_id"),  # type: ignore[arg-type]
        ("abort a bool id", lambda L: s.abort(True), ArgumentTypeError, "request_id"),
        ("abort an unknown id", lambda L: s.abort(12345), ArgumentValueError, "request_id"),
        ("result of a float id", lambda L: s.result(0.0), ArgumentTypeError, "request_id"),  # type: ignore[arg-type]
        ("result unknown", lambda L: s.result(12345), ArgumentValueError, "request_id"),
    ]
    tokens = cfg.num_blocks * cfg.block_size + 1  # one sample's KV past the whole pool
    if tokens + 1 <= cfg.max_model_len:
        calls.append(
            (
                "submit what no pool can hold",
                lambda L: s.submit(
                    Request(request_id=1002, prompt=(1,) * tokens, max_new_tokens=1)
                ),
                CapacityError,
                "pool",
            )
        )
    if live.pending is None:
        calls.append(("update without step", lambda L: s.update({}), InvalidRequestError, "update"))
        return calls
    seq_ids = sorted(live.sampled())
    in_flight = [r.request_id for r in w.requests if not _finished(s, r.request_id)]
    if in_flight:
        rid = in_flight[0]
        calls.append(("abort mid-step", lambda L: s.abort(rid), InvalidRequestError, "abort"))
    calls += [
        ("step twice", lambda L: s.step(), InvalidRequestError, "step"),
        ("update with a list", lambda L: s.update([1, 2]), ArgumentTypeError, "sampled"),  # type: ignore[arg-type]
        (
            "update with an extra id",
            lambda L: s.update(L.sampled() | {10**6: 1}),
            ArgumentValueError,
            "sampled",
        ),
        ("update with a bool id", lambda L: s.update({True: 1}), ArgumentTypeError, "sampled"),
    ]
    if seq_ids:
        last = seq_ids[-1]
        calls += [
            (
                "update missing an id",
                lambda L: s.update({k: v for k, v in L.sampled().items() if k != last}),
                ArgumentValueError,
                "sampled",
            ),
        ]
        for bad, error in [(-1, ArgumentValueError), (1.5, ArgumentTypeError),
                           (True, ArgumentTypeError), ("3", ArgumentTypeError),
                           (None, ArgumentTypeError), (2.0, ArgumentTypeError)]:  # fmt: skip
            calls.append((f"update with token {bad!r}", _update_with(last, bad), error,
                          f"sampled[{last}]"))  # fmt: skip
    return calls


def _update_with(seq_id: int, token: object) -> Callable[[_Live], object]:
    """An update that reports ``token`` for ``seq_id`` and the right token for the others."""
    return lambda live: live.sched.update(live.sampled() | {seq_id: token})  # type: ignore[arg-type]


def _finished(s: ContinuousScheduler, request_id: int) -> bool:
    try:
        s.result(request_id)
    except ArgumentValueError:
        return False
    return True


def _finish(live: _Live) -> None:
    """Carry on from ``live`` with valid calls; every healthy request ends, every block returns."""
    s = live.sched
    if live.pending is not None:
        s.update(live.sampled())
        live.pending = None
    for _ in range(10_000):
        if not s.has_unfinished():
            break
        live.pending = s.step()
        s.update(live.sampled())
        live.pending = None
        s.check_integrity()
    assert not s.has_unfinished()
    assert s.manager.pool.num_held == 0 and not s.manager.sequence_ids()
    assert s.host.num_free == s.config.num_host_blocks
    for r in live.workload.requests:
        assert s.result(r.request_id).outputs == expected_outputs(r)


@pytest.mark.parametrize("cls", [ContinuousScheduler, StaticScheduler], ids=lambda c: c.__name__)
@given(
    w=workloads(max_requests=5, max_prompt=12, max_new=5),
    steps=st.integers(0, 12),
    stop_pending=st.booleans(),
    data=st.data(),
)
def test_a_refused_call_changes_nothing_and_the_run_goes_on(
    cls: Callable[[SchedulerConfig], ContinuousScheduler],
    w: Workload,
    steps: int,
    stop_pending: bool,
    data: st.DataObject,
) -> None:
    live = _advance(w, cls, steps, stop_pending)
    calls = _bad_calls(live)
    for name, call, error, word in data.draw(
        st.lists(st.sampled_from(calls), min_size=1, max_size=4), label="bad calls"
    ):
        before = _snapshot(live.sched)
        with pytest.raises(error) as info:
            call(live)
        assert word in str(info.value), f"{name}: {info.value}"
        assert _snapshot(live.sched) == before, f"{name} changed the scheduler's state"
        live.sched.check_integrity()
    _finish(live)


def test_a_bad_request_never_enters_and_never_stalls_the_others() -> None:
    """The failures of the issue: a string prompt, a NaN priority, ``stop_tokens=5``."""
    s = ContinuousScheduler(SchedulerConfig(num_blocks=8, block_size=2, policy="priority"))
    good = Request(request_id=0, prompt=(1, 2, 3), max_new_tokens=3)
    s.submit(good)
    base: dict[str, object] = {"request_id": 1, "prompt": (4,), "max_new_tokens": 2}
    bads: list[dict[str, object]] = [
        {"prompt": ("a", "b")},
        {"priority": math.nan},
        {"stop_tokens": 5},
        {"n": 1.5},
    ]
    for bad in bads:
        with pytest.raises(InvalidRequestError):  # refused when made: it never reaches submit
            s.submit(Request(**(base | bad)))  # type: ignore[arg-type]
    while s.has_unfinished():
        out = s.step()
        s.update({x.seq_id: default_tokens(good, 0, x.position) for x in out.samples})
    assert s.result(0).outputs == expected_outputs(good) and s.manager.pool.num_held == 0
