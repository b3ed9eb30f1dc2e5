"""The resident copy of the spec's KV memory follows every write and copy, and only new K and V
cross: the fast reference judges from it exactly as it judges from a fresh upload."""

from __future__ import annotations

import contextlib
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import conformance.judges.oracle as oracle_module
import conformance.run.runner as runner_module
from conformance.judges.oracle import OracleChoice, layer_cache
from conformance.judges.resident_kv import ResidentKV
from conformance.judges.tile_plan import DEFAULT_MEMORY_LIMIT
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.errors import InvalidRequestError
from spec.quant import FP8_FORMATS

BLOCKS, B, H, D = 12, 4, 2, 3
SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 2.0**-20, 448.0]


def _assert_follows(memory: ResidentKV) -> None:
    """Every resident row equals the spec's memory, as stored, for every layer."""
    for layer in range(memory.num_layers):
        cache = layer_cache(OracleChoice("cpu", DEFAULT_MEMORY_LIMIT), memory, layer, None, 0)  # type: ignore[arg-type]
        assert cache.block_ids == tuple(memory.block_ids)
        want_k, want_v = memory.read_blocks(layer, memory.block_ids)
        for got, want in ((cache.key, want_k), (cache.value, want_v)):
            np.testing.assert_array_equal(got.numpy().astype(np.float64), want, strict=False)


writes = st.tuples(
    st.integers(0, 1),  # layer
    st.lists(st.integers(0, BLOCKS * B - 1), min_size=1, max_size=6, unique=True),
    st.integers(0, 2**32 - 1),
    st.booleans(),  # some values special (NaN, infinities, signed zero, fp8 edges)
)
copies = st.lists(
    st.tuples(st.integers(0, BLOCKS - 1), st.integers(0, BLOCKS - 1)), max_size=3
).map(lambda pairs: list({d: (s, d) for s, d in pairs if s != d}.values()))


@given(
    ops=st.lists(st.one_of(writes, copies), min_size=1, max_size=12),
    kv_dtype=st.sampled_from([None, *FP8_FORMATS]),
    lazy=st.booleans(),
)
def test_the_resident_copy_equals_the_spec_memory_after_any_writes_and_copies(
    ops: list[object], kv_dtype: str | None, lazy: bool
) -> None:
    scales = ((0.5, 2.0), (0.25, 4.0)) if kv_dtype else ()
    memory = ResidentKV(
        2, BLOCKS, B, H, D, device="cpu", kv_dtype=kv_dtype, kv_scales=scales, lazy=lazy
    )
    for op in ops:
        if isinstance(op, tuple):
            layer, slots, seed, special = op
            rng = np.random.default_rng(seed)
            k, v = (rng.standard_normal((len(slots), H, D)).astype(np.float16) for _ in "kv")
            if special:
                k.flat[::3] = rng.choice(SPECIAL, size=k.flat[::3].shape)
            sent = memory.sent_bytes
            memory.write(layer, k.astype(np.float64), v.astype(np.float64), slots)
            touched = len({s // B for s in slots})
            assert memory.sent_bytes - sent == 2 * touched * B * H * D * 4, "only what was written"
        else:
            with contextlib.suppress(InvalidRequestError):  # a pair the spec refuses
                memory.copy_blocks(op)  # type: ignore[arg-type]
        _assert_follows(memory)


def test_a_refused_write_changes_neither_copy() -> None:
    memory = ResidentKV(1, 4, 2, num_kv_heads=1, head_dim=1, device="cpu")
    memory.write(0, np.ones((1, 1, 1)), np.ones((1, 1, 1)), [0])
    with pytest.raises(InvalidRequestError):
        memory.write(0, np.ones((1, 1, 1)), np.ones((1, 1, 1)), [99])
    assert memory.block_ids == [0] and memory.sent_bytes == 16
    _assert_follows(memory)


def test_a_value_not_exact_in_float32_is_refused_not_rounded() -> None:
    memory = ResidentKV(1, 4, 2, num_kv_heads=1, head_dim=1, device="cpu")
    with pytest.raises(AssertionError, match="not exact in float32"):
        memory.write(0, np.full((1, 1, 1), 0.1), np.ones((1, 1, 1)), [0])


def _run(monkeypatch: pytest.MonkeyPatch, resident: bool) -> RunResult:
    """Every step judged by the fast reference, its cache resident (or read from the memory)."""
    choice = OracleChoice("cpu", DEFAULT_MEMORY_LIMIT, resident=resident)
    with monkeypatch.context() as patch:
        patch.setattr(oracle_module, "FAST_THRESHOLD", 0)
        patch.setattr(runner_module, "oracle_for_run", lambda *_: choice)
        return run_suite(
            NumpyPagedBackend(),
            "numpy",
            run_seed=8,
            database=None,
            max_examples=8,
            passes=("short",),
        )


def test_a_run_judged_from_the_resident_copy_checks_what_one_judged_from_the_memory_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A correct backend passes with the same counts: the copy followed every write, fork,
    copy-on-write and poisoning of the run (a missed one would judge stale K or V)."""
    resident, direct = _run(monkeypatch, True), _run(monkeypatch, False)
    assert resident.passed and direct.passed, (resident.difference, direct.difference)
    assert resident.stats.checks == direct.stats.checks
    assert resident.stats.steps == direct.stats.steps > 20
    assert Counter(resident.stats.rules) == Counter(direct.stats.rules)
    assert any("fork" in r for r in resident.stats.rules), "copies were exercised"
