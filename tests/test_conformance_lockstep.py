"""The lockstep machinery: workloads, comparisons, and each planted bug caught where expected."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch
from group_workloads import GROUP_WORKLOADS
from hypothesis import given
from hypothesis import strategies as st
from latent_workloads import LATENT_WORKLOADS
from speculative_workloads import SPECULATIVE_WORKLOADS
from variant_workloads import VARIANT_WORKLOADS

import conformance.lockstep.kv_check as kv_check_module
import spec.kv_memory as kv_memory
from conformance.errors import SpecSideBug, SuiteStopped
from conformance.judges.compare import first_kv_difference, first_output_difference
from conformance.judges.dtypes import round_to
from conformance.judges.numerics import output_errors
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.lockstep.sequences import VOCAB
from conformance.lockstep.workload import (
    TokenKV,
    WorkloadConfig,
    geometry_for,
    large_pool_base,
    scale_for,
)
from conformance.planted.backends import PLANTED, OnlineSoftmaxNoRescale, WritesPaddingSlot
from conformance.planted.selftest import SELFTEST_SEED
from conformance.reports.report import replay_script
from conformance.run.control import RunControl
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.attention import AttentionVariant
from spec.backend import Backend, ReferenceBackend


def _config(
    block_size: int = 4,
    kv_heads: int = 2,
    group: int = 2,
    dtype: str = "float32",
    large: bool = False,
    prefix_caching: bool = False,
    layers: int = 2,
    head_dim: int = 8,
    large_pool: bool = False,
) -> WorkloadConfig:
    geometry, heads = geometry_for(block_size, kv_heads, group, head_dim, dtype, layers)
    base = large_pool_base(geometry) if large_pool else 0
    scale = scale_for(head_dim, large)
    return WorkloadConfig(geometry, heads, scale, 11, prefix_caching, block_base=base)


@given(seed=st.integers(0, 2**32 - 1), gain=st.sampled_from([1.0, 1e-3, 300.0]))
def test_bfloat16_rounding_matches_torch(seed: int, gain: float) -> None:
    x = np.random.default_rng(seed).standard_normal(256).astype(np.float32) * np.float32(gain)
    expected = torch.from_numpy(x).to(torch.bfloat16).double().numpy()
    assert np.array_equal(round_to(x, "bfloat16"), expected)


@given(tokens=st.lists(st.integers(0, 9), min_size=1, max_size=12), layer=st.integers(0, 1))
def test_token_kv_depends_only_on_the_prefix(tokens: list[int], layer: int) -> None:
    truth = TokenKV(_config(dtype="bfloat16"))
    k, v = truth.rows(tokens, layer)
    for cut in range(1, len(tokens) + 1):
        k2, v2 = truth.rows(tokens[:cut], layer)
        assert np.array_equal(k[:cut], k2) and np.array_equal(v[:cut], v2)
    assert np.array_equal(round_to(k, "bfloat16"), k), "values must be representable"


# -- scripted workloads ----------------------------------------------------------------------


def _cow(ls: Lockstep) -> None:
    """Fork a 5-token sequence (B=4: the last block is partial), then both decode."""
    ls.add(0, [1, 2, 3, 4, 5])
    ls.step([(0, [1, 2, 3, 4, 5])])
    ls.fork(0, 1)
    ls.step([(1, [6]), (0, [7])])


def _chunked(ls: Lockstep) -> None:
    """A 7-token prompt prefilled in chunks of 3 and 4, so the second starts mid-sequence."""
    ls.add(0, [1, 2, 3, 4, 5, 6, 7])
    ls.step([(0, [1, 2, 3])])
    ls.step([(0, [4, 5, 6, 7])])


def _chunked_past_a_block(ls: Lockstep) -> None:
    """An 11-token prompt in chunks of 6 and 5: the second's cached context fills block 0 and
    reaches into block 1 (in a large pool, the first block past 2^31 elements)."""
    prompt = list(range(1, 12))
    ls.add(0, prompt)
    ls.step([(0, prompt[:6])])
    ls.step([(0, prompt[6:])])


def _interleaved(ls: Lockstep) -> None:
    """Two sequences grow in turns, so each one's blocks are not contiguous: [0, 2], [1, 3]."""
    ls.add(0, [1, 2, 3, 4, 5])
    ls.add(1, [6, 7, 8, 9, 10])
    ls.step([(0, [1, 2, 3, 4]), (1, [6, 7, 8, 9])])
    ls.step([(0, [5]), (1, [10])])
    assert ls.manager.block_table(0) == (0, 2)


def _decode_partial(ls: Lockstep) -> None:
    ls.add(0, [1, 2, 3, 4, 5])
    ls.step([(0, [1, 2, 3, 4, 5])])
    ls.step([(0, [6])])


def _wide(ls: Lockstep) -> None:
    """Six sequences in one step, then all decode: past the first four of a batch."""
    for s in range(6):
        ls.add(s, [s + 1, s + 2])
    ls.step([(s, [s + 1, s + 2]) for s in range(6)])
    ls.step([(s, [9]) for s in range(6)])


def _many_outputs(ls: Lockstep) -> None:
    """A 40-token prompt and a decode (over a thousand outputs), then the end of the workload."""
    prompt = [t % VOCAB for t in range(40)]
    ls.add(0, prompt)
    ls.step([(0, prompt)])
    ls.step([(0, [3])])
    ls.finish()


def _long_config() -> WorkloadConfig:
    geometry, heads = geometry_for(16, 2, 2, 8, "float32", 1, long_context=True)
    return WorkloadConfig(geometry, heads, scale_for(8, True), 5, long_context=True)


def _long_prompt(ls: Lockstep, length: int = 130) -> None:
    """A prompt past two 64-key tiles, prefilled in chunks of 100 and the rest, then a decode."""
    prompt = [t % VOCAB for t in range(length)]
    ls.add(0, prompt)
    assert ls.step([(0, prompt[:100])]) == [0]
    if length > 100:
        assert ls.step([(0, prompt[100:])]) == [0]
    assert ls.step([(0, [1])]) == [0]


def _long_sinks_config() -> WorkloadConfig:
    geometry, heads = geometry_for(16, 1, 2, 8, "float32", 1, long_context=True)
    sinks = AttentionVariant(sinks=(2.0, 2.5))
    return WorkloadConfig(geometry, heads, scale_for(8, False), 5, variants=(sinks,))


def _long_split(ls: Lockstep) -> None:
    """A prompt of 300 tokens, then a decode: a context the split-KV path takes."""
    _long_prompt(ls, 300)


WORKLOADS: dict[str, tuple[Callable[[Lockstep], None], WorkloadConfig, set[str]]] = {
    "SlotOffByOne": (_decode_partial, _config(), {"K"}),
    "IgnoresBlockTable": (_interleaved, _config(), {"output"}),
    "SkipsCopies": (_cow, _config(), {"K"}),
    "CopiesKeyOnly": (_cow, _config(), {"V"}),
    "CopiesBackwards": (_cow, _config(), {"K"}),
    "WritesPaddingSlot": (_decode_partial, _config(), {"K"}),
    "WrongGqaMapping": (_decode_partial, _config(), {"output"}),
    "ChunkMaskFromZero": (_chunked, _config(), {"output"}),
    "IgnoresPartialBlock": (_decode_partial, _config(), {"output", "exception"}),
    "ReadsPastSeqLen": (_decode_partial, _config(), {"output"}),
    "SoftmaxWithoutMax": (_decode_partial, _config(dtype="float16", large=True), {"output"}),
    "IgnoresScale": (_decode_partial, _config(large=True), {"output"}),
    "OnlineSoftmaxNoRescale": (_long_prompt, _long_config(), {"output"}),
    "WrongAtHeadDim128": (_decode_partial, _config(head_dim=128), {"output"}),
    "WrongPastFourSequences": (_wide, _config(block_size=16, layers=1), {"output"}),
    "PowerOfTwoBlockMath": (_decode_partial, _config(block_size=3), {"output", "exception"}),
    "WrongAtGqaRatio3": (_decode_partial, _config(group=3), {"output"}),
    "Int32Offsets": (_decode_partial, _config(layers=1, large_pool=True), {"K"}),
    "RoundsTowardZero": (_many_outputs, _config(dtype="float16", block_size=16), {"outputs"}),
    "Fp16Accumulation": (
        _many_outputs,
        _config(dtype="float16", block_size=16),
        {"output", "outputs"},  # check 1, or check 2 once P rounding is allowed for
    ),
    "ProductsInActivationDtype": (
        _many_outputs,
        _config(dtype="float16", block_size=16, large=True, head_dim=64),
        {"output"},
    ),
    "CausalOffByOne": (_chunked, _config(), {"output"}),
    "MasksByZeroWeight": (_decode_partial, replace(_config(), poison="NaN"), {"output"}),
    "Int32OffsetsInCachedContext": (
        _chunked_past_a_block,
        _config(layers=1, large_pool=True),
        {"output"},
    ),
    "SinksWrongOnSplitKV": (_long_split, _long_sinks_config(), {"output"}),
    **VARIANT_WORKLOADS,  # the variant and fp8 bugs: tests/variant_workloads.py
    **GROUP_WORKLOADS,  # the KV cache group bugs: tests/group_workloads.py
    **SPECULATIVE_WORKLOADS,  # the speculative bugs: tests/speculative_workloads.py
    **LATENT_WORKLOADS,  # the latent KV bugs: tests/latent_workloads.py
}


def test_every_planted_bug_has_a_scripted_workload() -> None:
    assert {cls.__name__ for cls in PLANTED.values()} == set(WORKLOADS)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_scripted_workload_passes_on_correct_backends(name: str) -> None:
    workload, config, _ = WORKLOADS[name]
    for backend in (ReferenceBackend(), NumpyPagedBackend()):
        ls = Lockstep(backend, config)
        workload(ls)
        ls.finish()
        assert ls.checks["attention outputs judged against the same-precision reference"] > 0


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_scripted_workload_catches_its_planted_bug(name: str) -> None:
    workload, config, kinds = WORKLOADS[name]
    cls = next(c for c in PLANTED.values() if c.__name__ == name)
    with pytest.raises(ConformanceFailure) as caught:
        workload(Lockstep(cls(), config))
    assert caught.value.difference.what in kinds, caught.value.difference.describe()


def test_copy_bug_is_located_at_the_copying_sequence_and_block() -> None:
    workload, config, _ = WORKLOADS["SkipsCopies"]
    with pytest.raises(ConformanceFailure) as caught:
        workload(Lockstep(PLANTED["copy-on-write copy not executed"](), config))
    diff = caught.value.difference
    assert (diff.what, diff.seq_id, diff.token, diff.layer) == ("K", 1, 4, 0)
    assert diff.max_abs_error is not None and diff.max_abs_error > 0
    assert "sequence 1, token 4" in diff.describe()


def test_prefix_hit_reuses_the_cached_kv_and_still_conforms() -> None:
    ls = Lockstep(ReferenceBackend(), _config(prefix_caching=True))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    ls.add(0, prompt)
    ls.step([(0, prompt)])
    assert ls.add(1, [*prompt[:8], 99]) == 8  # two full blocks from the cache
    ls.step([(1, [99])])
    assert ls.manager.block_table(1)[:2] == ls.manager.block_table(0)[:2]


def test_failed_allocation_leaves_the_sequence_out_and_unchanged() -> None:
    ls = Lockstep(NumpyPagedBackend(), _config())
    too_long = list(range(4 * 15))  # 15 blocks of 4; the pool has 14
    ls.add(0, too_long)
    assert ls.step([(0, too_long)]) == []
    assert ls.manager.num_tokens(0) == 0
    assert ls.checks["failed allocations left the state unchanged"] == 1


class _Raises(NumpyPagedBackend):
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:  # type: ignore[override]
        raise RuntimeError("kernel launch failed")


class _WrongShape(NumpyPagedBackend):
    def attention(self, layer, query, batch, scale):  # type: ignore[no-untyped-def, override]
        return super().attention(layer, query, batch, scale)[:, :1]


@pytest.mark.parametrize(("backend", "what"), [(_Raises(), "exception"), (_WrongShape(), "shape")])
def test_a_misbehaving_backend_is_reported_not_crashed_on(backend: Backend, what: str) -> None:
    with pytest.raises(ConformanceFailure) as caught:
        _decode_partial(Lockstep(backend, _config()))
    assert caught.value.difference.what == what
    assert "the backend failed" in caught.value.difference.describe()


# -- comparisons ---------------------------------------------------------------------------


def test_kv_difference_prefers_a_live_token_over_a_stray_slot() -> None:
    expected = np.zeros((8, 1, 2))
    actual = expected.copy()
    actual[1, 0, 0] = 1.0  # slot 1: nobody's
    actual[6, 0, 1] = np.nan  # slot 6: sequence 3, token 2
    diff = first_kv_difference(4, 0, "V", expected, actual, {6: (3, 2)}, block_size=4)
    assert diff is not None
    assert (diff.seq_id, diff.token, diff.block, diff.offset) == (3, 2, 1, 2)
    assert diff.max_abs_error == float("inf")
    assert first_kv_difference(4, 0, "V", expected, expected.copy(), {}, 4) is None


def test_kv_difference_says_what_went_wrong_and_where_the_row_landed() -> None:
    expected = np.arange(8.0).reshape(8, 1, 1)
    at_start = expected.copy()
    at_start[5] = -1.0
    diff = first_kv_difference(0, 0, "K", expected, at_start, {}, block_size=4)
    assert diff is not None and "background write" in diff.detail
    assert "in no slot compared" in diff.detail and "stray" not in diff.detail
    shifted = expected.copy()
    shifted[3], shifted[4] = expected[4], -1.0  # slot 4's row written one slot early
    diff = first_kv_difference(2, 0, "K", expected, shifted, {}, block_size=4)
    assert diff is not None and diff.offset == 3
    assert "missing or stray write or copy" in diff.detail and "in no slot" in diff.detail
    diff = first_kv_difference(2, 0, "K", expected, shifted, {4: (0, 4)}, block_size=4)
    assert diff is not None and (diff.seq_id, diff.token) == (0, 4)
    assert "the expected row is in slot 3 (block 0, offset 3)" in diff.detail


def test_output_difference_allows_what_a_same_precision_kernel_errs_by() -> None:
    exact = np.linspace(-1.0, 1.0, 24).reshape(3, 2, 4)
    same = round_to(exact, "float16")
    errors = output_errors(exact, same, same, "float16")
    assert (
        errors.passed and first_output_difference(1, 0, exact, same, errors, [(0, 0)] * 3) is None
    )
    far = same.copy()
    far[2, 1, 3] += 0.01
    errors = output_errors(exact, same, far, "float16")
    diff = first_output_difference(1, 0, exact, far, errors, [(0, 5), (0, 6), (4, 9)])
    assert diff is not None and diff.numerics is not None
    assert (diff.seq_id, diff.token, diff.head) == (4, 9, 1)
    assert diff.numerics.excess > 1 and "x the allowed" in diff.describe()


# -- shrinking and replay ----------------------------------------------------------------------


def test_a_found_failure_shrinks_to_a_replayable_script() -> None:
    ref = "conformance.planted.backends:WritesPaddingSlot"
    result = run_suite(
        PLANTED["padding slot -1 written (into the last slot)"](), ref, run_seed=7, database=None
    )
    assert result.difference is not None
    assert len(result.workload) <= 4, result.workload  # Lockstep(), add, step
    with pytest.raises(ConformanceFailure) as replayed:
        exec(replay_script(result), {})
    assert replayed.value.difference == result.difference


# -- long contexts ---------------------------------------------------------------------------


def test_online_softmax_without_rescale_is_exact_within_one_tile() -> None:
    """The planted bug hides up to 64 keys: only a longer context can catch it."""
    _long_prompt(Lockstep(OnlineSoftmaxNoRescale(), _long_config()), length=63)  # 64 keys: exact
    with pytest.raises(ConformanceFailure) as caught:
        _long_prompt(Lockstep(OnlineSoftmaxNoRescale(), _long_config()))
    diff = caught.value.difference
    assert diff.what == "output" and diff.token is not None and diff.token >= 64


def test_the_quick_profile_catches_a_bug_past_64_keys() -> None:
    ref = "conformance.planted.backends:OnlineSoftmaxNoRescale"
    result = run_suite(
        OnlineSoftmaxNoRescale(), ref, run_seed=SELFTEST_SEED, database=None, shrink=False
    )
    assert result.difference is not None, "the quick profile missed a long-context bug"
    assert result.difference.what == "output"
    assert result.difference.token is not None and result.difference.token >= 64


@pytest.mark.heavy
def test_long_context_workloads_pass_1024_tokens() -> None:
    """The quick profile of the reference reaches past the 256/512/1024-key switch points."""
    result = run_suite(ReferenceBackend(), "reference", run_seed=1, database=None)
    assert result.passed, result.difference
    assert result.stats.rules["add (long prompt, 300..1100 tokens)"] > 0
    assert result.stats.longest > 1024
    assert any(shape.endswith("long-context") for shape in result.stats.configs)


def test_a_spec_pool_held_lazily_is_compared_like_a_whole_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At device scale the spec's pool passes 2^26 elements a layer and holds only the blocks
    written (``spec.kv_memory.LAZY_ELEMENTS``): every comparison must read it as it reads a
    whole one (a decode of 64 sequences at 2,048 tokens failed here with an IndexError)."""
    monkeypatch.setattr(kv_memory, "LAZY_ELEMENTS", 0)
    result = run_suite(
        NumpyPagedBackend(), "numpy", run_seed=4, database=None, max_examples=4, passes=("short",)
    )
    assert result.passed, result.difference
    assert result.stats.checks["whole-pool comparisons"] > 0


@pytest.mark.parametrize("backend", [NumpyPagedBackend, WritesPaddingSlot])
def test_a_pool_read_back_in_parts_is_judged_as_one_read_whole(
    backend: type[Backend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``READ_ELEMENTS`` a comparison reads the pool by blocks, a part at a time, so that a
    device-scale pool is never copied whole: a correct backend still passes, and a bug is
    reported with the same first difference as when the pool is read in one piece."""

    def run() -> RunResult:
        return run_suite(
            backend(),
            "b",
            run_seed=7,
            database=None,
            max_examples=6,
            passes=("short",),
            control=RunControl(shrink=False),
        )

    whole = run()
    monkeypatch.setattr(kv_check_module, "READ_ELEMENTS", 1)  # one block a read
    parts = run()
    assert parts.passed == whole.passed == (backend is NumpyPagedBackend)
    if not whole.passed:
        assert parts.difference is not None and whole.difference is not None
        assert parts.difference.describe() == whole.difference.describe()
    assert parts.stats.checks == whole.stats.checks


def _truth_corrupted_at(ls: Lockstep, seq_id: int, position: int) -> None:
    """Make the suite's ground truth of one token differ from what the spec holds."""
    _, k, _ = ls._truth._kept[(seq_id, 0)]
    k[position] += 1.0


def test_the_spec_is_checked_against_the_truth_where_a_step_wrote_and_at_each_sweep() -> None:
    """On a large pool a step checks the spec's KV from its sequences' first block it wrote on
    (re-reading whole contexts cost more than the attention), and a sweep checks every token:
    a difference in a block the step wrote is found at once, one elsewhere at the next sweep."""
    ls = Lockstep(NumpyPagedBackend(), _config(layers=1), whole_pool_slots=0)
    prompt = list(range(1, 10))  # blocks of 4: positions 8.. are in the third block
    ls.add(0, prompt)
    ls.step([(0, prompt)])
    _truth_corrupted_at(ls, 0, 0)  # the first block: the next decode does not write it
    ls.step([(0, [3])])
    assert ls.checks["spec KV equals the tokens' ground truth"] < 2 * len(prompt)
    _truth_corrupted_at(ls, 0, 9)  # the decode's own block
    with pytest.raises(SuiteStopped, match="sequence 0, layer 0 is not what was written") as e:
        ls.step([(0, [4])])
    assert isinstance(e.value.error, SpecSideBug)  # the spec's state: not the backend's failure

    ls = Lockstep(NumpyPagedBackend(), _config(layers=1), whole_pool_slots=0)
    ls.add(0, prompt)
    ls.step([(0, prompt)])
    _truth_corrupted_at(ls, 0, 0)
    with pytest.raises(SuiteStopped, match=r"spec/ or in the suite, not the backend: .* is not"):
        ls.check_cache()  # what a sweep (every SWEEP_EVERY steps) and finish() run
