"""The suite on latent KV (multi-head latent attention): what it draws, how it judges, what it
reports. The planted latent bugs and their scripted workloads are in
``test_conformance_lockstep.py`` (through ``latent_workloads.py``)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from latent_workloads import latent_config

from conformance.errors import SetupError
from conformance.judges import fast_reference as fr
from conformance.judges.device_contract import ContractMismatch, DeviceContract
from conformance.judges.dtypes import F64, round_to
from conformance.judges.oracle import OracleChoice, layer_cache
from conformance.judges.resident_kv import ResidentKV
from conformance.judges.tile_plan import DEFAULT_MEMORY_LIMIT
from conformance.lockstep.configs import configs
from conformance.lockstep.driver import Lockstep
from conformance.lockstep.envelope import CPU, DEVICE
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.lockstep.plan import LATENT, LATENT_FP8, Plan, plan_for
from conformance.lockstep.workload import (
    LARGE_LOGIT_GAIN,
    SequenceTruth,
    TokenKV,
    WorkloadConfig,
    nope_dims,
)
from conformance.run.causes import excluding, from_replays
from conformance.run.runner import run_suite
from spec.attention_batched import paged_attention_batched as spec_attention
from spec.backend import ReferenceBackend
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities
from spec.errors import InvalidRequestError
from spec.kv_geometry import KV_DTYPES, KVGeometry
from spec.kv_memory import KVMemory

LATENT_CAPS = NumpyPagedBackend(latent=None).capabilities


def _pass(caps: Capabilities, feature: str | None = None, kind: str = "feature") -> Plan:
    return next(
        p
        for p in plan_for(caps).passes()
        if p.kind == kind and (feature is None or p.feature == feature)
    )


# -- what is drawn -------------------------------------------------------------------------


def test_latent_is_drawn_only_where_declared_and_as_declared() -> None:
    assert plan_for(LATENT_CAPS).latent == CPU.latent == ((32, 16), (16, 16))
    features = [p.feature for p in plan_for(LATENT_CAPS).passes() if p.kind == "feature"]
    assert features[-2:] == [LATENT, LATENT_FP8]
    only = plan_for(Capabilities("x", latent={(512, 64)}))
    assert only.latent == ((512, 64),)
    assert "latent layouts: drawn exactly as declared: 512+64" in only.notes
    assert LATENT_FP8 not in [p.feature for p in only.passes()]  # no fp8 KV dtype declared
    plain = plan_for(Capabilities("x"))
    assert plain.latent == () and LATENT not in [p.feature for p in plain.passes()]


def test_both_envelopes_run_deepseek_v3s_layout_as_a_production_shape() -> None:
    device = plan_for(LATENT_CAPS, device="cuda:0")
    assert (512, 64) in device.latent and (512, 64) in DEVICE.latent
    shapes = [p.shape for p in device.passes() if p.kind == "production"]
    latent = [s for s in shapes if s is not None and s.latent_dim is not None]
    assert [s.describe() for s in latent] == ["latent 512+64, 128 query heads, block size 64"]
    # on the CPU too (every head tile of a GPU's plan), two sequences wide: each query token
    # costs eight interpreted programs; the other passes draw small latent layouts only
    cpu = plan_for(LATENT_CAPS)
    assert (512, 64) not in cpu.latent
    plans = [p for p in cpu.passes() if p.kind == "production"]
    latent_cpu = [p for p in plans if p.shape is not None and p.shape.latent_dim is not None]
    assert [p.shape.describe() for p in latent_cpu if p.shape] == [
        "latent 512+64, 128 query heads, block size 16"
    ]
    assert latent_cpu[0].widths == (2,)
    # a backend that declares only small layouts gets the nearest of them
    small = plan_for(Capabilities("x", latent={(32, 16)}))
    shapes = [p.shape for p in small.passes() if p.kind == "production"]
    assert [s.describe() for s in shapes if s is not None and s.latent_dim] == [
        "latent 32+16, 128 query heads, block size 16"
    ]


def test_a_layout_the_backend_vetoes_is_left_out_and_named() -> None:
    def veto(g: KVGeometry, heads: int, variant: object) -> str | None:
        return "rows of 48 unsupported" if g.head_dim == 48 else None

    plan = plan_for(Capabilities("x", latent=None, excludes=veto))
    assert plan.latent == ((16, 16),)
    assert "latent layout 32+16: excluded by the backend (rows of 48 unsupported)" in plan.skipped


@settings(max_examples=40, deadline=None)
@given(data=st.data(), feature=st.sampled_from([LATENT, LATENT_FP8]))
def test_a_latent_pass_draws_latent_rows_at_the_models_scale(
    data: st.DataObject, feature: str
) -> None:
    config = data.draw(configs(_pass(LATENT_CAPS, feature)))
    g = config.geometry
    assert g.is_latent and g.num_kv_heads == 1 and g.rope_dim is not None
    assert (g.latent_dim, g.rope_dim) in CPU.latent and config.num_heads in CPU.latent_heads
    assert (g.kv_dtype is not None) == (feature == LATENT_FP8)
    assert all(k == v for k, v in g.kv_scales), "one scale for the whole latent row"
    gains = [config.scale * math.sqrt(n + g.rope_dim) for n in nope_dims(*g.kv_widths)]
    assert any(math.isclose(x, gain) for x in gains for gain in (1.0, LARGE_LOGIT_GAIN))
    for gain in (1.0, LARGE_LOGIT_GAIN):  # never the row width's: that is the planted mistake
        assert not math.isclose(config.scale, gain / math.sqrt(g.head_dim))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_short_pass_mixes_latent_examples_among_the_others(data: st.DataObject) -> None:
    config = data.draw(configs(_pass(LATENT_CAPS, kind="short")))
    assert config.geometry.num_kv_heads == 1 or not config.geometry.is_latent
    if config.geometry.is_latent and config.geometry.kv_dtype is not None:
        assert all(k == v for k, v in config.geometry.kv_scales)


def test_latent_is_reachable_in_the_short_pass_and_never_drawn_without_the_declaration() -> None:
    short = configs(_pass(LATENT_CAPS, kind="short"))
    fast = settings(phases=[Phase.generate], database=None)
    assert find(short, lambda c: c.geometry.is_latent, settings=fast).geometry.num_kv_heads == 1
    assert not find(short, lambda c: True).geometry.is_latent  # shrinks to per-head K and V

    @settings(max_examples=30, deadline=None)
    @given(configs(_pass(Capabilities("x"), kind="short")))
    def never(config: WorkloadConfig) -> None:
        assert not config.geometry.is_latent

    never()


@given(tokens=st.lists(st.integers(0, 9), min_size=1, max_size=10), fp8=st.booleans())
def test_latent_truth_rows_have_their_parts_widths_and_depend_only_on_the_prefix(
    tokens: list[int], fp8: bool
) -> None:
    config = latent_config(dtype="bfloat16", kv_dtype="fp8_e5m2" if fp8 else None)
    truth = TokenKV(config)
    c_kv, k_rope = truth.rows(tokens, 0)
    assert c_kv.shape == (len(tokens), 1, 32) and k_rope.shape == (len(tokens), 1, 16)
    kept = SequenceTruth(truth)
    for cut in range(1, len(tokens) + 1):
        a, b = kept.rows(0, tokens[:cut], 0)
        assert np.array_equal(a, c_kv[:cut]) and np.array_equal(b, k_rope[:cut])


# -- how it is judged ----------------------------------------------------------------------


_Step = tuple[KVMemory, ResidentKV, BatchMetadata, np.ndarray]


@st.composite
def _latent_steps(draw: st.DrawFn) -> _Step:
    """A latent memory of random rows (and its resident copy, written alike) and a step of
    decodes and prefill chunks over it."""
    b = draw(st.sampled_from([1, 3, 4, 16]))
    latent, rope = draw(st.sampled_from([(32, 16), (16, 16), (8, 4)]))
    kv_dtype = draw(st.sampled_from([None, *KV_DTYPES]))
    lens = draw(st.lists(st.integers(1, 70), min_size=1, max_size=3))
    counts = [draw(st.sampled_from([1, n])) for n in lens]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    need = [-(-n // b) for n in lens]
    pool = rng.permutation(sum(need) + 2).tolist()
    dims = (1, len(pool), b, 1, latent + rope)
    kv = {"kv_dtype": kv_dtype, "kv_scales": ((0.02, 0.02),) if kv_dtype else ()}
    memory = KVMemory(*dims, latent_dim=latent, **kv)  # type: ignore[arg-type]
    resident = ResidentKV(*dims, device="cpu", latent_dim=latent, **kv)  # type: ignore[arg-type]
    tables, slots = [], []
    for n, count in zip(lens, counts, strict=True):
        blocks = [pool.pop() for _ in range(-(-n // b))]
        tables.append(tuple(blocks + [-1] * (max(need) - len(blocks))))
        row_slots = [blocks[p // b] * b + p % b for p in range(n)]
        c_kv, k_rope = (round_to(rng.normal(size=(n, 1, w)), "float16") for w in (latent, rope))
        memory.write(0, c_kv, k_rope, row_slots)
        resident.write(0, c_kv, k_rope, row_slots)
        slots += row_slots[n - count :]
    starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
    positions = [p for n, c in zip(lens, counts, strict=True) for p in range(n - c, n)]
    batch = BatchMetadata(b, tuple(range(len(lens))), tuple(starts), tuple(lens), tuple(tables),
                          tuple(slots), tuple(positions))  # fmt: skip
    heads = draw(st.sampled_from([1, 2, 8]))
    query = rng.normal(size=(batch.num_tokens, heads, latent + rope))
    return memory, resident, batch, query


@settings(max_examples=40, deadline=None)
@given(step=_latent_steps())
def test_the_fast_reference_and_the_resident_copy_judge_latent_rows_as_the_spec(
    step: _Step,
) -> None:
    memory, resident, batch, query = step
    scale = 1 / math.sqrt(24)
    want = spec_attention(query, batch, memory, 0, scale)
    assert want.shape == (*query.shape[:2], memory.latent_dim)
    read = [b for row in batch.block_tables for b in row if b >= 0]
    caches = [
        fr.PagedKV.from_memory(memory, 0, "cpu"),
        fr.PagedKV.from_memory(memory, 0, "cpu", blocks=read),
        layer_cache(OracleChoice("cpu", DEFAULT_MEMORY_LIMIT), resident, 0, batch, 0),
    ]
    for cache in caches:
        assert cache.latent
        got = fr.paged_attention(query, batch, cache, scale).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)


def test_a_latent_lockstep_judges_every_output_and_compares_both_parts() -> None:
    config = replace(latent_config(dtype="float16"), prefix_caching=True, poison="NaN")
    ls = Lockstep(ReferenceBackend(), config)
    ls.add(0, [1, 2, 3, 4, 5, 6, 7])
    ls.step([(0, [1, 2, 3])])
    ls.step([(0, [4, 5, 6, 7])])
    ls.fork(0, 1)
    ls.step([(1, [8]), (0, [9])])
    assert ls.add(2, [1, 2, 3, 4, 5, 6, 7, 8, 1]) == 8  # a prefix hit on latent rows
    ls.step([(2, [1])])
    ls.finish()
    assert ls.checks["attention outputs judged against the same-precision reference"] == 10
    lines = ls.coverage.describe()
    assert "KV layouts: latent (c_kv + k_rope) 32+16, with 4 query heads" in lines


# -- bad input -----------------------------------------------------------------------------


def test_a_value_wider_than_the_key_is_refused_naming_both() -> None:
    import torch

    with pytest.raises(InvalidRequestError, match="PagedKV key and value differ"):
        fr.PagedKV(torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 48))


def test_the_device_contract_names_the_latent_part_of_a_wrong_read() -> None:
    import torch

    dc = DeviceContract(Capabilities("x", tensors="torch"), latent_config().geometry)
    names = ("c_kv", "k_rope")

    def read(k_rope_width: int) -> tuple[F64, F64]:
        got = (torch.zeros(1, 4, 1, 32), torch.zeros(1, 4, 1, k_rope_width))
        return dc.blocks("read_blocks(0, ...)", got, (1, 4, 1, 32), value_shape=(1, 4, 1, 16),
                         names=names)  # fmt: skip

    assert read(16)[1].shape == (1, 4, 1, 16)
    with pytest.raises(ContractMismatch, match=r"read_blocks\(0, \.\.\.\) k_rope returned shape"):
        read(48)  # per-head: the whole row


def test_a_latent_failure_is_excluded_by_its_layout_and_the_latent_passes_then_draw_nothing() -> (
    None
):
    cause = from_replays([("layout", "latent")])  # it passed as per-head K and V
    assert cause.describe() == "the latent layout (the workload passes without it)"
    caps = excluding(LATENT_CAPS, [cause])
    assert caps.unsupported(latent_config().geometry, 4)
    assert not caps.unsupported(KVGeometry(1, 4, 4, 2, 8), 4)
    vetoed = replace(_pass(LATENT_CAPS, LATENT), caps=caps).vetoed()
    assert vetoed == "the backend's excludes vetoes the latent layouts on every shape"


# -- what is reported ----------------------------------------------------------------------


def test_the_latent_passes_reach_every_path_and_the_report_lists_them() -> None:
    result = run_suite(NumpyPagedBackend(latent=None), "numpy-latent", run_seed=7, database=None,
                       passes=["feature"])  # fmt: skip
    assert result.passed, result.difference and result.difference.describe()
    cov = result.stats.coverage.paths
    for feature in ("latent", "fp8+latent"):
        for path in ("single-pass decode", "split-KV decode", "prefill", "mixed"):
            assert cov.pairs[(feature, path)], (feature, path)
    assert cov.pairs[("latent+cached context", "prefill")]
    assert cov.pairs[("latent+cached context", "mixed")]
    lines = result.stats.coverage.describe()
    assert any(
        line.startswith("KV layouts: per-head K and V; latent (c_kv + k_rope)") for line in lines
    )
    assert any(line.startswith("  latent: single-pass decode") for line in lines)
    assert any(name.startswith("latent ") for name in result.stats.drawn)


class _LatentOnly(NumpyPagedBackend):
    """An MLA kernel: the latent layout 32 + 16 and nothing else (per-head K and V vetoed)."""

    @property
    def capabilities(self) -> Capabilities:
        def veto(g: KVGeometry, heads: int, variant: object) -> str | None:
            return None if g.is_latent else "per-head K and V: this is an MLA kernel"

        return replace(super().capabilities, latent=frozenset({(32, 16)}), excludes=veto)


def test_a_latent_only_backend_is_checked_on_latent_rows_alone() -> None:
    plan = plan_for(_LatentOnly().capabilities)
    assert plan.latent_only and plan.latent == ((32, 16),)
    assert any(
        line.startswith("per-head K and V: excluded by the backend") for line in plan.skipped
    )
    passes = ("short", "feature", "groups")  # per-variant and fp8 passes on latent rows too
    result = run_suite(
        _LatentOnly(), "mla", run_seed=3, database=None, max_examples=2, passes=passes
    )
    assert result.passed, result.difference and result.difference.describe()
    assert result.stats.drawn["latent 32+16"] == result.stats.examples
    assert not result.stats.coverage.ordinary
    with pytest.raises(SetupError, match="vetoes every shape"):
        plan_for(replace(_LatentOnly().capabilities, latent=frozenset()))


def test_a_query_of_the_wrong_width_is_refused_naming_the_latent_parts() -> None:
    memory = KVMemory(1, 4, 4, 1, 48, latent_dim=32)
    batch = BatchMetadata(4, (0,), (0, 1), (1,), ((0,),), (0,), (0,))
    with pytest.raises(
        InvalidRequestError, match=r"expected \[1, H, 48\] \(q_latent 32 \+ q_rope 16\)"
    ):
        fr.paged_attention(np.zeros((1, 2, 32)), batch, fr.PagedKV.from_memory(memory, 0, "cpu"))


def test_the_pytest_way_writes_and_reads_a_latent_only_backend_in_its_layout() -> None:
    from conformance.testing import BackendConformance

    BackendConformance().test_write_then_read_returns_the_values_exactly(_LatentOnly())
