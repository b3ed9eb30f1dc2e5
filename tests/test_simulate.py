"""The serving simulator: it runs on the spec's schedulers, conserves tokens, and reproduces
the ordering Orca and the PagedAttention paper argue
(continuous beats static, paging packs memory tighter)."""

from __future__ import annotations

import doctest
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import paged_spec.sim.cost
import paged_spec.sim.heap
import paged_spec.sim.run
import paged_spec.sim.traffic
import paged_spec.simulate
from paged_spec.sim.cost import GPU_PRESETS, MODEL_PRESETS, idle_step_seconds, step_seconds
from paged_spec.sim.heap import FirstFitHeap, replay
from paged_spec.sim.run import POLICIES, EngineConfig, admission_error, run
from paged_spec.sim.traffic import (
    DOCUMENT,
    LENGTH_PRESETS,
    TraceRequest,
    load_trace,
    mixed_trace,
    poisson_trace,
    save_trace,
)
from paged_spec.simulate import SimConfig, main, simulate, write_outputs
from spec.errors import CapacityError
from spec.metrics import RequestTimeline
from spec.request import Request

ROOT = Path(__file__).resolve().parent.parent
DOCS_RESULTS = ROOT / "docs" / "assets" / "simulate" / "results.json"
SMALL = SimConfig(num_requests=60, rates=(8.0, 96.0), kv_pool_gib=1.0, member_seconds=1.0)


@pytest.fixture(scope="module")
def small() -> dict[str, Any]:
    return simulate(SMALL)


@pytest.mark.parametrize(
    "module", [paged_spec.sim.cost, paged_spec.sim.traffic, paged_spec.sim.heap]
)
def test_doctests(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0, result


def test_results_fields(small: dict[str, Any]) -> None:
    assert set(small) == {"config", "main", "sweep", "timelines", "membership", "summary"}
    assert small["main"]["rate"] == 96.0
    for policy in POLICIES:
        m = small["main"]["runs"][policy]
        for key in ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
            assert m[key] is not None and m[key] > 0, (policy, key, m[key])
        assert m["ttft_p50_s"] <= m["ttft_p99_s"] and m["itl_p50_s"] <= m["itl_p99_s"], policy
        assert 0 < m["kv_util_mean"] <= 1, (policy, m["kv_util_mean"])
        assert m["preemptions"] >= 0
        assert m["rejected"] == 0 and m["classes"]["default"]["requests"] == SMALL.num_requests
        assert len(small["sweep"]["runs"][policy]) == 2
        tl = small["timelines"][policy]
        assert len(tl["t"]) == len(tl["kv_util"]) == len(tl["batch"]) > 10
    assert set(small["membership"]) == {"static", "static-eager", "paged"}
    for policy, by_request in small["membership"].items():
        runs = [run for rs in by_request.values() for run in rs]
        assert runs and all(0 <= a < b for a, b in runs), policy  # seconds, each a step or more
        assert min(a for a, _ in runs) < SMALL.member_seconds, policy


def test_continuous_beats_static_and_paging_packs_tighter(small: dict[str, Any]) -> None:
    s, runs = small["summary"], small["main"]["runs"]
    assert s["continuous_over_static_throughput"] > 1.5, s
    assert s["scheduling_gain"] > 1.0 and s["memory_gain"] > 1.0, s
    assert s["paged_kv_utilization"] >= s["contiguous_kv_utilization"], s
    for static in ("static", "static-eager"):  # batches formed by their worst case never preempt
        assert runs[static]["preemptions"] == 0, static
    assert runs["static-eager"]["idle_steps"] == runs["paged"]["idle_steps"] == 0
    assert runs["contiguous"]["block_size"] == SMALL.max_model_len


def test_every_token_is_served_once(small: dict[str, Any]) -> None:
    trace = SMALL.trace(SMALL.rates[-1])
    expected = sum(r.output_len for r in trace)
    for policy in POLICIES:
        assert small["main"]["runs"][policy]["output_tokens"] == expected, policy


@given(
    lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200)), min_size=1, max_size=12),
    gaps=st.lists(st.floats(0.0, 0.05), min_size=12, max_size=12),
    pool_blocks=st.integers(32, 96),
)
def test_random_traces_finish_every_request(
    lengths: list[tuple[int, int]], gaps: list[float], pool_blocks: int
) -> None:
    """Any small trace on any small pool: every policy serves every output token exactly once."""
    arrivals = [sum(gaps[: i + 1]) for i in range(len(lengths))]
    trace = [TraceRequest(a, p, o) for a, (p, o) in zip(arrivals, lengths, strict=False)]
    engine = EngineConfig(
        GPU_PRESETS["h200"],
        MODEL_PRESETS["llama-3.1-8b"],
        pool_tokens=pool_blocks * 16,
        max_model_len=512,
        max_num_batched_tokens=256,
    )
    for policy in POLICIES:
        m, tl = run(policy, trace, engine)
        assert m["output_tokens"] == sum(o for _, o in lengths), policy
        assert all(0.0 <= u <= 1.0 for u in tl.kv_util), policy
        assert tl.end == sorted(tl.end), policy
        assert m["ttft_p50_s"] > 0, policy


def test_roofline_is_flat_then_linear() -> None:
    gpu, model = GPU_PRESETS["h200"], MODEL_PRESETS["llama-3.1-8b"]
    flat = [step_seconds(gpu, model, [(1, 1)] * n) for n in (1, 32, 128)]
    assert max(flat) / min(flat) < 1.01, flat
    big = [step_seconds(gpu, model, [(1, 1)] * n) for n in (1000, 2000)]
    assert math.isclose(big[1] / big[0], 2.0, rel_tol=0.01), big
    with pytest.raises(ValueError, match="new_tokens <= context"):
        step_seconds(gpu, model, [(5, 4)])


def test_trace_round_trip_and_errors(tmp_path: Path) -> None:
    trace = poisson_trace(LENGTH_PRESETS["alpaca"], rate=5.0, num_requests=20, seed=3)
    path = tmp_path / "trace.jsonl"
    save_trace(path, trace)
    assert load_trace(path) == trace
    path.write_text('{"arrival": 0.5, "prompt_len": 0, "output_len": 3}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1"):
        load_trace(path)
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="not a trace row"):
        load_trace(path)
    with pytest.raises(ValueError, match="rate > 0"):
        poisson_trace(LENGTH_PRESETS["alpaca"], rate=0.0, num_requests=3)


def test_cli_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = poisson_trace(LENGTH_PRESETS["alpaca"], rate=20.0, num_requests=40, seed=1)
    save_trace(tmp_path / "t.jsonl", trace)
    argv = ["--traffic", str(tmp_path / "t.jsonl"), "--rates", "10,40", "--kv-pool-gib", "0.5"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--jobs", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "continuous/static throughput:" in out and "KV utilization" in out, out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    scaled = SimConfig(traffic=str(tmp_path / "t.jsonl")).trace(rate=10.0)
    assert [r.prompt_len for r in scaled] == [r.prompt_len for r in trace]
    assert math.isclose(len(scaled) / scaled[-1].arrival, 10.0), scaled[-1]
    assert results["main"]["rate"] == 40.0
    for name in ("rate_sweep.png", "kv_utilization.png", "batch_membership.png"):
        png = (tmp_path / "out" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, name
    for bad, says in [  # argparse errors are in tests/test_cli_args.py
        (["--traffic", "nope"], "nope"),
        (["--kv-pool-gib", "0.01"], "cannot hold one 2048-token sequence"),
    ]:
        assert main([*bad, "--out", str(tmp_path / "x")]) == 2, bad
        assert says in capsys.readouterr().err, bad
    assert not (tmp_path / "x").exists()


def test_worker_processes_give_the_same_results() -> None:
    tiny = SimConfig(num_requests=12, rates=(50.0,), kv_pool_gib=0.5, member_seconds=0.2)
    assert simulate(tiny, jobs=2) == simulate(tiny, jobs=1)


def test_write_outputs_without_plots(small: dict[str, Any], tmp_path: Path) -> None:
    assert write_outputs(small, tmp_path, plots=False) == [tmp_path / "results.json"]


@pytest.mark.heavy
def test_docs_figures_come_from_this_code() -> None:
    """The committed results behind docs/simulator.md are what the code computes today.

    Regenerate with ``python -m paged_spec.simulate --out docs/assets/simulate`` if this fails.
    """
    committed = json.loads(DOCS_RESULTS.read_text())
    saved = {k: v for k, v in committed["config"].items() if k in SimConfig.__dataclass_fields__}
    cfg = SimConfig(**saved | {"rates": tuple(saved["rates"])})
    assert cfg == SimConfig(), "the docs must show the default run"
    rate = committed["main"]["rate"]
    for policy in POLICIES:
        fresh, _ = run(policy, cfg.trace(rate), cfg.engine())
        fresh = json.loads(json.dumps(fresh))  # the same rounding trip as the file
        assert fresh == committed["main"]["runs"][policy], (
            f"{policy}: docs/assets/simulate/results.json is stale; regenerate it with "
            "`python -m paged_spec.simulate --out docs/assets/simulate`"
        )
    paged = committed["summary"]["paged_kv_utilization"]
    assert paged >= 0.96, f"paged KV utilization {paged:.1%} on the ShareGPT-like preset"
    for name in ("rate_sweep.png", "kv_utilization.png", "batch_membership.png"):
        assert (DOCS_RESULTS.parent / name).stat().st_size > 10_000, name


def test_static_batch_waits_to_fill_on_an_idle_clock() -> None:
    """Static batching idles, one tick a step, until its batch fills or times out."""
    engine = replace(TINY, max_num_seqs=2, static_wait_steps=50)
    tick = idle_step_seconds(engine.gpu, engine.model)
    pair = [TraceRequest(0.0, 10, 3), TraceRequest(0.1, 10, 3)]  # the second fills the batch
    _, tl = run("static", pair, engine)
    ticks = math.ceil(0.1 / tick)  # the second is seen at the first tick after it arrives
    assert ticks < 50 and tl.idle_steps == ticks and tl.idle_s == pytest.approx(ticks * tick)
    assert [tl.requests[r].first_scheduled_step for r in (0, 1)] == [ticks, ticks]
    _, alone = run("static", pair[:1], engine)  # never full: it starts when it has waited 50
    assert alone.idle_steps == 50 and alone.requests[0].first_scheduled_step == 50
    assert alone.end[49] == pytest.approx(50 * tick) and alone.batch[:50] == [0] * 50
    _, eager = run("static-eager", pair, engine)  # takes whoever is waiting: request 0 alone
    assert eager.idle_steps == 0 and eager.requests[0].first_scheduled_step == 0
    first_finish = eager.requests[0].finish_step
    assert first_finish is not None
    assert eager.requests[1].first_scheduled_step == first_finish + 1


# -- the lessons' switches: admission control, chunking, request classes, fragmentation --

TINY = EngineConfig(
    GPU_PRESETS["h200"],
    MODEL_PRESETS["llama-3.1-8b"],
    pool_tokens=64 * 16,
    max_model_len=512,
    max_num_batched_tokens=256,
)


def _alpaca(n: int, rate: float) -> list[TraceRequest]:
    return poisson_trace(LENGTH_PRESETS["alpaca"], rate=rate, num_requests=n, seed=2)


def test_admission_cap_rejects_early_in_blocks() -> None:
    trace = _alpaca(80, rate=400.0)
    open_door, tl_open = run("paged", trace, TINY)
    capped, tl = run("paged", trace, replace(TINY, admission_blocks=64))
    assert open_door["rejected"] == 0 and not tl_open.rejections
    assert 0 < capped["rejected"] == len(tl.rejections) < len(trace)
    assert capped["overall"]["requests"] + capped["rejected"] == len(trace)
    assert set(tl.rejections).isdisjoint(tl.requests)  # a rejected request never entered
    message = next(iter(tl.rejections.values()))
    assert "blocks are held" in message and "admission cap of 64 blocks" in message, message
    served = sum(trace[r].output_len for r in tl.requests)
    assert capped["output_tokens"] == served
    assert capped["queue_delay_p99_s"] < open_door["queue_delay_p99_s"]


def test_admission_error_is_a_capacity_error() -> None:
    sched = TINY.scheduler("paged")
    request = _request_for(TraceRequest(0.0, 100, 5))
    assert admission_error(None, sched, {}, request) is None
    assert admission_error(7, sched, {}, request) is None  # 100 tokens: 7 blocks of 16
    error = admission_error(7, sched, {9: 1}, request)
    assert isinstance(error, CapacityError) and "1 more are queued" in str(error)


def _request_for(r: TraceRequest) -> Request:
    return paged_spec.sim.run._request(0, r, TINY)


def test_max_chunk_tokens_bounds_the_stall_a_long_prompt_causes() -> None:
    chats = [TraceRequest(0.001 * i, 20, 60, "chat") for i in range(6)]
    trace = [*chats, TraceRequest(0.02, 480, 5, "long")]
    engine = replace(TINY, max_num_batched_tokens=512)
    whole, _ = run("paged", trace, engine)
    chunked, _ = run("paged", trace, replace(engine, max_chunk_tokens=32))
    assert replace(engine, max_chunk_tokens=32).scheduler("paged").config.max_chunk_tokens == 32
    assert chunked["classes"]["chat"]["itl_max_s"] < whole["classes"]["chat"]["itl_max_s"]
    assert chunked["classes"]["long"]["ttft_mean_s"] > whole["classes"]["long"]["ttft_mean_s"]


def test_class_metrics_add_up(small: dict[str, Any]) -> None:
    trace = mixed_trace([(LENGTH_PRESETS["alpaca"], 0.7), (DOCUMENT, 0.3)], 50.0, 30, seed=1)
    m, _ = run("paged", trace, replace(TINY, pool_tokens=512 * 16, max_model_len=8192))
    assert set(m["classes"]) == {"alpaca", "document"}
    assert sum(c["requests"] for c in m["classes"].values()) == m["overall"]["requests"] == 30
    assert sum(c["preemptions"] for c in m["classes"].values()) == m["preemptions"]
    for c in m["classes"].values():
        assert c["ttft_p50_s"] <= c["ttft_p99_s"] and c["e2e_mean_s"] >= c["ttft_mean_s"]
    assert small["main"]["runs"]["paged"]["classes"]["default"]["requests"] == SMALL.num_requests


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=40))
def test_first_fit_heap_never_overlaps(ops: list[tuple[bool, int]]) -> None:
    heap, held = FirstFitHeap(40), dict[int, int]()
    for alloc, n in ops:
        if alloc or not held:
            start = heap.allocate(n)
            if start is None:
                assert heap.largest_hole < n
            else:
                held[start] = n
        else:
            start = sorted(held)[n % len(held)]
            heap.free(start)
            del held[start]
        spans = sorted(held.items())
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans)), spans
        assert all(a >= 0 and a + n <= 40 for a, n in spans)
        assert heap.free_slots == 40 - sum(held.values()) >= heap.largest_hole


def test_replay_finds_external_fragmentation() -> None:
    """Three requests of 4 slots in a heap of 14; the middle one finishes, leaving holes of 4
    and 2: both later requests of 6 fail although 6 slots are free."""
    trace = [TraceRequest(0, 3, 1), TraceRequest(0, 3, 1), TraceRequest(0, 3, 1)]
    trace += [TraceRequest(0, 5, 1), TraceRequest(0, 5, 1)]
    timelines = {
        rid: RequestTimeline(rid, "default", 0, 0.0, first_scheduled_step=start, finish_step=end)
        for rid, (start, end) in enumerate([(0, 9), (0, 1), (0, 9), (3, 9), (3, 9)])
    }
    r = replay(timelines, trace, slots=14)
    assert (r.allocations, r.failed, r.failed_with_room) == (5, 2, 2)
    assert r.largest_hole_share == pytest.approx(4 / 6)
