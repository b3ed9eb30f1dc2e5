"""The bounds checker against planted kernels written like an outside project's adapter.

Each adapter builds its own tensors from :class:`~spec.batch.BatchMetadata` (its
own table layout: tight, wider with another row stride, a view into a bigger
buffer, column-major) and launches its own Triton kernel, as vLLM's or
SGLang's kernels are wired to the contract. Each planted bug leaves every
output right, so only an address-level check can see it; the project's own
Triton backend must pass in strict mode.
"""

from __future__ import annotations

# First: on a CPU-only machine this sets TRITON_INTERPRET, which must happen before triton
# is first imported (its standard library's kernels are decorated then).
import backend_gpu  # noqa: F401

# isort: split
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from backend_helpers import assert_attention_close, fewer_examples, make_scenario
from hypothesis import given
from hypothesis import strategies as st

from backend_gpu.kernels._checks import interpreting
from backend_gpu.triton_backend import TritonBackend
from benchmarks import bounds as bench_bounds
from conformance.bounds import _hooks as _bounds_hooks
from conformance.bounds.checker import CONTRACT, GPU_NOTE, BoundsChecker, Violation, Watched
from conformance.planted.kernels import (
    EXACT,
    FLOOR_PLUS_ONE,
    WHOLE_TILE,
    batch_of,
    cache_for,
    expected_sum,
    paged_sum,
)
from spec.attention import paged_attention as reference_attention
from spec.backend import ReferenceBackend
from spec.batch import BatchMetadata, GroupLayout
from spec.kv_geometry import KVGeometry

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="the bounds checker needs TRITON_INTERPRET=1 (a CPU run)"
)
FEW = fewer_examples(3, minimum=5)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "bounds-checking.md"


@triton.jit  # type: ignore[untyped-decorator]
def _kv_write(  # type: ignore[no-untyped-def]
    key_ptr,
    cache_ptr,
    slots_ptr,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    BUG: tl.constexpr,
):
    """cache[slot] = key[token], ROW = H_kv * D elements a slot; slot -1 writes nothing."""
    tok = tl.program_id(0)
    i = tl.arange(0, ROW_PAD)
    slot = tl.load(slots_ptr + tok + i * 0)  # the token's slot, once per lane
    x = tl.load(key_ptr + tok * ROW + i, mask=i < ROW, other=0.0)
    if BUG == 1:  # one element too many: the last slot's store runs past the cache
        ok = (i < ROW + 1) & (slot >= 0)
    elif BUG == 2:  # padding slots (-1) not skipped: writes the row before the cache
        ok = i < ROW
    else:
        ok = (i < ROW) & (slot >= 0)
    tl.store(cache_ptr + slot * ROW + i, x, mask=ok)


@triton.jit  # type: ignore[untyped-decorator]
def _gather(src_ptr, offs_ptr, out_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    """out[i] = src[offs[i]], unmasked: whatever offsets it is given, it reads."""
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.load(src_ptr + tl.load(offs_ptr + i)))


@triton.jit  # type: ignore[untyped-decorator]
def _masked_wild(src_ptr, out_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    """Every lane's address is far outside ``src``, and every lane is masked off."""
    i = tl.arange(0, N)
    x = tl.load(src_ptr + 1_000_000 + i, mask=i < 0, other=1.0)
    tl.store(out_ptr + 1_000_000 + i, x, mask=i < 0)
    tl.store(out_ptr + i, x)


@triton.jit  # type: ignore[untyped-decorator]
def _atomics(ptr, OFF: tl.constexpr):  # type: ignore[no-untyped-def]
    """An atomic add to four elements and a compare-and-swap of one, from element ``OFF``."""
    i = tl.arange(0, 4)
    tl.atomic_add(ptr + OFF + i, 1)
    tl.atomic_cas(ptr + OFF, 0, 5)


# -- adapters: an outside project wiring its kernels to the contract ---------------------------


def kv_write(key: torch.Tensor, cache: torch.Tensor, slots: list[int], bug: int = EXACT) -> None:
    row = key.shape[1] * key.shape[2]
    slot_tensor = torch.tensor(slots, dtype=torch.int64)
    _kv_write[(len(slots),)](
        key, cache, slot_tensor, ROW=row, ROW_PAD=triton.next_power_of_2(row + 1), BUG=bug
    )


def watched_sum(
    batch: BatchMetadata, bug: int, layout: str, strict: bool
) -> tuple[Watched, torch.Tensor]:
    k_cache, checker = cache_for(batch), BoundsChecker(strict=strict)
    with checker.watch("attention", layer=0, batch=batch) as seen:
        out = paged_sum(k_cache, batch, bug, layout)
    torch.testing.assert_close(out, expected_sum(k_cache, batch))  # outputs are never affected
    assert checker.violations == seen.violations
    return seen, out


# -- the planted bugs --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["tight", "wide", "view", "colmajor"])
def test_a_correct_kernel_passes_strict_mode_with_any_table_layout(layout: str) -> None:
    seen, _ = watched_sum(batch_of([8, 11, 3], block_size=4), EXACT, layout, strict=True)
    assert seen.violations == []
    assert seen.tables == ["_paged_sum:table_ptr"], "the adapter's table was not recognised"
    assert seen.launches == 1 and seen.accesses > 0


def test_one_entry_past_a_row_is_flagged_in_strict_mode_only() -> None:
    batch = batch_of([8, 11], block_size=4)  # row 0 uses 2 of 3 entries; floor + 1 reads entry 2
    default, _ = watched_sum(batch, FLOOR_PLUS_ONE, "tight", strict=False)
    assert default.violations == []
    strict, _ = watched_sum(batch, FLOOR_PLUS_ONE, "tight", strict=True)
    (v,) = strict.violations
    assert (v.kind, v.access, v.argument) == ("padding", "load", "table_ptr")
    assert (v.kernel, v.row, v.entry, v.used, v.distance, v.count, v.offset) == (
        "_paged_sum",
        0,
        2,
        2,
        1,
        1,
        2,
    )
    assert "row 0, entry 2, the row uses 2" in v.describe()


def test_strict_mode_finds_a_windowed_groups_table_by_its_released_entries() -> None:
    """Group 1's rows start with released ``-1`` entries; they are used entries, not padding."""
    group1 = GroupLayout(((-1, 5, 6), (-1, 7, -1)), (24, 29))  # rows use 3 and 2 entries
    batch = BatchMetadata(4, (0, 1), (0, 1, 2), (9, 6), ((0, 1, 2), (3, 4, -1)), (8, 17), (8, 5))
    batch = replace(batch, extra_groups=(group1,))
    table = torch.tensor(group1.block_tables, dtype=torch.int32)
    for offsets, padding in (([0, 1, 2, 3], []), ([1, 2, 4, 5], [(1, 2)])):  # 5: row 1, entry 2
        checker, out = BoundsChecker(strict=True), torch.zeros(4, dtype=torch.int32)
        with checker.watch("attention", layer=1, batch=batch) as seen:
            _gather[(1,)](table, torch.tensor(offsets, dtype=torch.int32), out, N=4)
        assert seen.tables == ["_gather:src_ptr"], "group 1's table was not recognised"
        assert [(v.row, v.entry) for v in seen.violations if v.kind == "padding"] == padding


def test_reading_past_the_table_tensor_is_flagged_in_both_modes() -> None:
    batch = batch_of([8, 11], block_size=4)  # a 2 x 3 table read as 2 x 4: row 1 reads entry 3
    for strict in (False, True):
        seen, _ = watched_sum(batch, WHOLE_TILE, "tight", strict=strict)
        outside = [v for v in seen.violations if v.kind == "outside"]
        (v,) = outside
        assert (v.access, v.argument, v.tensor, v.inside_storage) == (
            "load",
            "table_ptr",
            "int32 [2, 3]",
            False,
        )
        assert (v.offset, v.distance, v.worst, v.count, v.program) == (6, 1, 1, 1, (1, 0, 0))
        padding = [v for v in seen.violations if v.kind == "padding"]
        # Row 0's entry 3 is row 1's entry 0 at the same address: only entry 2 is padding.
        assert [(p.row, p.entry) for p in padding] == ([(0, 2)] if strict else [])


def test_the_docs_sample_is_the_planted_kernels_real_report() -> None:
    seen, _ = watched_sum(batch_of([8, 11], block_size=4), WHOLE_TILE, "tight", strict=True)
    text = " ".join(line.removeprefix("> ") for line in DOCS.read_text().splitlines())
    text = " ".join(text.split())
    for v in seen.violations:
        assert v.describe() in text, f"docs/bounds-checking.md lacks: {v.describe()}"
    assert " ".join(CONTRACT.split()) in text and " ".join(GPU_NOTE.split()) in text


def test_a_view_of_a_bigger_buffer_is_only_its_own_elements() -> None:
    """Past the last row of ``buf[:2, :3]`` is inside the buffer but outside the tensor."""
    seen, _ = watched_sum(batch_of([8, 11], block_size=4), WHOLE_TILE, "view", strict=False)
    (v,) = seen.violations
    assert (v.kind, v.argument, v.inside_storage, v.distance) == ("outside", "table_ptr", True, 1)
    strict, _ = watched_sum(batch_of([8, 11], block_size=4), WHOLE_TILE, "view", strict=True)
    (p,) = [p for p in strict.violations if p.kind == "padding"]
    assert (p.row, p.entry, p.count) == (0, 2, 2), "row 0's padding entry 2, then the gap at 3"


def test_rows_past_the_batch_in_a_wider_table_count_as_padding() -> None:
    """A 4 x 6 table for 2 sequences, read 8 entries a row: row 1 runs into row 2's entries."""
    seen, _ = watched_sum(batch_of([8, 11], block_size=4), WHOLE_TILE, "wide", strict=True)
    (v,) = seen.violations
    assert (v.kind, v.row, v.entry, v.used) == ("padding", 0, 2, 2)
    assert v.count == 4 + 3 + 2, "row 0: entries 2-5; row 1: entries 3-5; row 2 (unused): 0-1"


@given(
    seq_lens=st.lists(st.integers(1, 24), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 2, 4, 8]),
    layout=st.sampled_from(["tight", "wide", "view", "colmajor"]),
    seed=st.integers(0, 3),
)
@FEW
def test_floor_plus_one_reads_one_padding_entry_per_row_that_fills_its_blocks(
    seq_lens: list[int], block_size: int, layout: str, seed: int
) -> None:
    """The exact kernel never violates; floor + 1 over-reads once for each row with B | seq_len."""
    batch = batch_of(seq_lens, block_size, seed)
    exact, _ = watched_sum(batch, EXACT, layout, strict=True)
    assert exact.violations == [] and len(exact.tables) == 1
    if layout == "wide":  # the extra entry is always inside the table tensor
        seen, _ = watched_sum(batch, FLOOR_PLUS_ONE, layout, strict=True)
        flagged = sum(v.count for v in seen.violations)
        assert {v.kind for v in seen.violations} <= {"padding"}
        assert flagged == sum(n % block_size == 0 for n in seq_lens)
        default, _ = watched_sum(batch, FLOOR_PLUS_ONE, layout, strict=False)
        assert default.violations == []


def test_writing_one_element_past_the_cache_is_flagged_as_a_store_and_not_performed() -> None:
    num_slots, row = 6, 2 * 4
    buf = torch.zeros(num_slots * row + 1)
    cache = buf[:-1].view(num_slots, 1, 2, 4)  # a sentinel element just past the cache
    key = torch.arange(3 * row, dtype=torch.float32).reshape(3, 2, 4) + 1
    slots = [0, num_slots - 1, 2]
    buf[-1] = 7.0
    checker = BoundsChecker()
    with checker.watch("write_kv", layer=0) as seen:
        kv_write(key, cache, slots, bug=1)
    (v,) = seen.violations
    assert (v.kind, v.access, v.argument, v.count) == ("outside", "store", "cache_ptr", 1)
    assert (v.offset, v.distance, v.inside_storage, v.program) == (
        num_slots * row,
        1,
        True,
        (1, 0, 0),
    )
    assert "1 store outside every tensor" in v.describe() and "1 past the end" in v.describe()
    assert buf[-1] == 7.0, "the refused store was performed"
    kv_write(key, cache, slots, bug=1)  # unchecked, the same kernel overwrites the sentinel
    assert buf[-1] == 0.0


def test_an_unskipped_padding_slot_writes_before_the_cache() -> None:
    cache = torch.zeros(4, 2, 1, 4)
    key = torch.ones(2, 1, 4)
    with BoundsChecker().watch("write_kv", 0) as seen:
        kv_write(key, cache, [3, -1], bug=2)
    (v,) = seen.violations
    assert (v.access, v.argument, v.offset, v.distance, v.worst, v.count) == (
        "store",
        "cache_ptr",
        -4,
        -4,
        -4,
        4,
    )
    assert "4 before the start" in v.describe()
    assert torch.equal(cache.reshape(-1, 4)[3], torch.ones(4))  # the real write still happened


@given(
    shape=st.sampled_from([(3, 5), (4, 4), (2, 7)]),
    view=st.sampled_from(["whole", "rows", "cols", "transposed"]),
    offsets=st.lists(st.integers(-12, 40), min_size=8, max_size=8),
)
@FEW
def test_an_access_is_allowed_exactly_when_it_falls_in_the_views_element_span(
    shape: tuple[int, int], view: str, offsets: list[int]
) -> None:
    guard = torch.arange(200, dtype=torch.float32)  # the view lives in the middle of it
    base = guard[60 : 60 + shape[0] * shape[1]].view(shape)
    src = {"whole": base, "rows": base[1:], "cols": base[:, 1:3], "transposed": base.t()}[view]
    first = 0
    last = sum(s * (n - 1) for s, n in zip(src.stride(), src.shape, strict=True))
    out = torch.empty(8)
    with BoundsChecker().watch("gather") as seen:
        _gather[(1,)](src, torch.tensor(offsets, dtype=torch.int64), out, N=8)
    outside = [o for o in offsets if not first <= o <= last]
    assert sum(v.count for v in seen.violations) == len(outside)
    if outside:
        (v,) = seen.violations
        assert v.argument == "src_ptr" and v.offset == outside[0] and v.inside_storage
        assert v.distance == (outside[0] - first if outside[0] < first else outside[0] - last)
    inside = [i for i, o in enumerate(offsets) if first <= o <= last]
    flat = guard[src.storage_offset() :]
    assert torch.equal(out[inside], flat[[offsets[i] for i in inside]])


def test_masked_off_lanes_are_never_accesses() -> None:
    src, out = torch.zeros(4), torch.zeros(4)
    with BoundsChecker(strict=True).watch("wild") as seen:
        _masked_wild[(1,)](src, out, N=4)
    assert seen.violations == [] and seen.accesses == 4  # only the four real stores
    assert torch.equal(out, torch.ones(4))


def test_atomics_past_the_tensor_are_flagged_and_not_performed() -> None:
    buf = torch.zeros(10, dtype=torch.int32)
    target = buf[:6]  # four sentinels after it, inside the same storage
    with BoundsChecker().watch("atomics") as seen:
        _atomics[(1,)](target, OFF=4)  # add to elements 4..7, swap element 4
    (v,) = seen.violations
    assert (v.access, v.argument, v.offset, v.distance, v.worst, v.count) == (
        "atomic",
        "ptr",
        6,
        1,
        2,
        2,
    )
    assert buf.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    with BoundsChecker().watch("atomics") as seen:
        _atomics[(1,)](target, OFF=6)  # everything past the end, the swap too
    assert [(v.count, v.distance, v.worst) for v in seen.violations] == [(5, 1, 4)]
    assert buf.tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]


# -- the project's own backend -----------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_the_triton_backend_passes_strict_mode(block_size: int) -> None:
    """Prefill + decodes, GQA 2, split-KV forced: no access outside, no padding read."""
    s = make_scenario(
        block_size,
        [(0, 9), (13, 1), (40, 1), (5, 3)],
        block_size=block_size,
        num_kv_heads=2,
        group=2,
        head_dim=8,
    )
    layers, blocks, b, kv_heads, d = s.geometry_args
    backend = TritonBackend(device="cpu", num_splits=4)
    checker = BoundsChecker(strict=True)
    with checker.watch("create_cache"):
        backend.create_cache(KVGeometry(layers, blocks, b, kv_heads, d))
    for layer, k, v, slots in s.context_writes:
        with checker.watch("write_kv", layer):
            backend.write_kv(layer, k.astype(np.float32), v.astype(np.float32), slots)
    key, value = s.keys[0].astype(np.float32), s.values[0].astype(np.float32)
    with checker.watch("write_kv", 0):
        junk = np.full((1, *key.shape[1:]), 9.0, dtype=np.float32)  # a padding row, slot -1
        backend.write_kv(
            0,
            np.concatenate([key, junk]),
            np.concatenate([value, junk]),
            [*s.batch.slot_mapping, -1],
        )
    with checker.watch("attention", 0, s.batch) as seen:
        out = backend.attention(0, s.queries[0].astype(np.float32), s.batch, 0.3)
    assert checker.violations == [], [v.describe() for v in checker.violations]
    assert seen.tables == ["_attention_kernel:block_tables_ptr"] and seen.launches == 2
    assert checker.notes() == [] and "0 violations" in checker.summary()
    want = reference_attention(s.queries[0], s.batch, s.memory, 0, 0.3)
    assert_attention_close(out, want, "float32", s.batch, 0, "triton under the checker")


# -- the hooks: only inside watch, restored exactly ---------------------------------------------


def _interpreter_state() -> tuple[dict[str, object], dict[str, object]]:
    """The builder's attributes (less the grid position each launch sets) and the executor's."""
    from triton.runtime import interpreter

    builder = vars(interpreter.interpreter_builder)
    own = {k: v for k, v in builder.items() if k not in ("grid_idx", "grid_dim")}
    return own, dict(vars(interpreter.GridExecutor))


def test_hooks_exist_only_inside_watch_and_are_restored_exactly_also_on_errors() -> None:
    before = _interpreter_state()
    checker = BoundsChecker()
    with checker.watch("attention", 0):
        assert _interpreter_state() != before
    assert _interpreter_state() == before
    with pytest.raises(ValueError, match="the call failed"), checker.watch("attention", 0):
        raise ValueError("the call failed")
    assert _interpreter_state() == before
    with pytest.raises(Exception, match="power of 2"), checker.watch("gather") as seen:
        _gather[(1,)](torch.zeros(4), torch.zeros(3, dtype=torch.int64), torch.empty(3), N=3)
    assert _interpreter_state() == before and seen.launches == 1


def test_watch_cannot_nest() -> None:
    checker = BoundsChecker()
    with checker.watch("a"), pytest.raises(RuntimeError, match="cannot nest"), checker.watch("b"):
        pass
    assert not _bounds_hooks._active


def test_a_backend_without_triton_kernels_gets_the_gpu_note() -> None:
    backend, checker = ReferenceBackend(), BoundsChecker(strict=True)
    with checker.watch("create_cache"):
        backend.create_cache(KVGeometry(1, 2, 2, 1, 2))
    with checker.watch("attention", 0, batch_of([3], 2)) as seen:
        pass
    assert seen.launches == 0 and checker.violations == []
    (note,) = checker.notes()
    assert "no Triton kernel ran under the interpreter" in note and GPU_NOTE in note
    assert "0 launches" in checker.summary()


def test_without_a_usable_interpreter_watch_checks_nothing_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_bounds_hooks, "interpreter_available", lambda: "no triton here")
    before, checker = _interpreter_state(), BoundsChecker()
    with checker.watch("attention", 0) as seen:
        assert _interpreter_state() == before
        _gather[(1,)](torch.zeros(4), torch.zeros(4, dtype=torch.int64), torch.empty(4), N=4)
    assert seen.launches == 0 and checker.violations == []
    assert checker.notes() == [f"nothing was bounds-checked: no triton here; {GPU_NOTE}"]


def test_strict_mode_says_when_it_found_no_table() -> None:
    checker = BoundsChecker(strict=True)
    with checker.watch("gather", 0, batch_of([8, 11], 4)):
        _gather[(1,)](torch.zeros(4), torch.zeros(4, dtype=torch.int64), torch.empty(4), N=4)
    (note,) = checker.notes()
    assert note.startswith("strict mode found no block-table argument")


def test_violation_lines_name_everything_a_kernel_author_needs() -> None:
    v = Violation(
        "attention",
        2,
        "k",
        3,
        "load",
        "padding",
        "tables",
        "int32 [4, 6]",
        True,
        13,
        2,
        3,
        5,
        (0, 1, 0),
        row=2,
        entry=1,
        used=0,
    )
    line = v.describe()
    for part in (
        "attention (layer 2)",
        "kernel k",
        "launch 3",
        "5 loads",
        "tables",
        "row 2, entry 1, the row uses 0",
        "2 past (worst 3)",
        "(0, 1, 0)",
    ):
        assert part in line, (part, line)
    assert re.fullmatch(r"[^\n]+", line)


def test_the_benchmark_prints_each_mode_against_the_unchecked_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_bounds.main(["--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("one attention call (6 tokens, 2 sequences)")
    assert [line.split()[0] for line in lines[1:]] == ["unchecked", "default", "strict"]
    assert lines[1].endswith("1.00x unchecked")
