"""The capacity tool's allocator runs: the hybrid 27B's numbers, and what windows release.

The figures come from admitting sequences into the spec's own memory side
until one does not fit (:mod:`paged_spec._capacity_alloc`); where a formula
exists (one full-attention group plus a fixed state), the two must agree.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_spec._capacity_alloc import allocator_fit, group_layout
from paged_spec.capacity import PRESETS, ModelKV, allocator_fits, capacity, main, windowless_fit
from spec.kv_budget import MIB, cdiv


def test_hybrid_27b_from_the_allocator() -> None:
    """One maximum reservation against ten 32,768-token sessions, as the worked example says."""
    reserve, sessions = allocator_fits(PRESETS["hybrid-27b"])
    assert (reserve.context, reserve.sequences, reserve.state_slots) == (262_144, 1, 1)
    assert (sessions.context, sessions.sequences, sessions.state_slots) == (32_768, 10, 10)
    assert sessions.block_bytes == MIB and sessions.blocks == 23_859 - 10 * 144


@settings(max_examples=15)
@given(
    blocks_per_state=st.integers(1, 8),
    context_blocks=st.integers(1, 6),
    pool_blocks=st.integers(0, 120),
    tail=st.integers(0, 3),
)
def test_the_allocator_agrees_with_the_formula(
    blocks_per_state: int, context_blocks: int, pool_blocks: int, tail: int
) -> None:
    """For a full-attention group and a state: sequences = pool // (KV + state), both ways."""
    block = 2 * 2 * 1 * 4 * 2  # 2 layers, 1 KV head of 4, bf16, B = 2: bytes of one block
    model = ModelKV(
        "m", num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=2, block_size=2,
        state_bytes=blocks_per_state * block, context=2 * context_blocks - tail % 2,
        max_len=2 * context_blocks, pool_bytes=pool_blocks * block + tail,
    )  # fmt: skip
    formula = capacity(model)
    reserve, sessions = allocator_fits(model)
    assert sessions.sequences == formula.paged_fit
    assert reserve.sequences == formula.contiguous_fit  # max_len is whole blocks here


def test_windows_release_and_fit_more() -> None:
    gemma = PRESETS["gemma-style"]
    layout = group_layout(gemma)
    assert layout.layers == 8 and len(layout.groups) == 6  # 1 full + 5 windowed groups of 8
    [fit], whole = allocator_fits(gemma), windowless_fit(gemma)
    assert whole.sequences == capacity(gemma).paged_fit == 4  # no release: the formula's count
    per_window_group = cdiv(1024 - 1, 16) + 1  # a decoding sequence's window: 65 blocks
    per_sequence = cdiv(16_384, 16) + 5 * per_window_group
    assert fit.sequences == fit.blocks // per_sequence == 18
    wider = allocator_fit(ModelKV(**{**gemma.__dict__, "window": 4096}), gemma.context)
    assert whole.sequences < wider.sequences < fit.sequences


def test_cli_prints_the_allocator_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "hybrid-27b"]) == 0
    out = capsys.readouterr().out
    rows = [" ".join(line.split()) for line in out.splitlines() if line.startswith("allocator")]
    assert rows == [
        "allocator, 262,144 tokens 1 1 state slot + 23,715 blocks of 1 MiB",
        "allocator, 32,768 tokens 10 10 state slots + 22,419 blocks of 1 MiB",
    ]
    assert main(["--model", "gemma-style", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["allocator"]["fits"][0]["sequences"] == 18
    assert row["allocator"]["windows_kept_whole"]["sequences"] == 4
    assert main(["--model", "gemma-style", "--window-layers", "0"]) == 0
    assert "allocator" not in capsys.readouterr().out  # no windows, no state: the formula says it
    assert main(["--model", "llama-3.1-8b", "--window-layers", "8"]) == 2
    assert "needs a --window" in capsys.readouterr().err
