"""Beam search over the paged engine returns exactly the beams of a plain contiguous beam search.

Every step forks beams with several survivors and frees those with none,
so copy-on-write copies a shared partial block for all but its last writer;
a wrong copy, a block freed too early or a fork that shares the wrong table
changes some beam's logits, and so its tokens or score.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_spec import engine_demo
from paged_spec.engine.beam_search import contiguous_beam_search, paged_beam_search
from paged_spec.engine.tiny_model import TinyModel
from spec.backend import ReferenceBackend
from spec.errors import ArgumentValueError, OutOfBlocksError
from spec.kv_budget import cdiv

MODEL = TinyModel()


@settings(max_examples=12)
@given(
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=30),
    width=st.integers(1, 4),
    steps=st.integers(1, 7),
    block_size=st.sampled_from([1, 2, 4, 16]),
)
def test_paged_beams_equal_contiguous_beams(
    prompt: list[int], width: int, steps: int, block_size: int
) -> None:
    found, record = paged_beam_search(
        MODEL, ReferenceBackend(), prompt, width, steps, block_size=block_size, num_blocks=160
    )
    plain = contiguous_beam_search(MODEL, prompt, width, steps)
    assert [b.tokens for b in found] == [b.tokens for b in plain]
    for a, b in zip(found, plain, strict=True):
        assert math.isclose(a.score, b.score, rel_tol=1e-5, abs_tol=1e-5)
    for s in record:
        assert s.beams == width and s.held_at_fork <= s.held <= s.clones
        assert s.clones == width * cdiv(len(prompt) + s.step, block_size)
        assert s.copies <= s.forks  # a copy only where a fork shares a partial block


def test_the_seeds_two_against_eight() -> None:
    """Width 4 on a 20-token prompt with 16-token blocks: 2 blocks shared where clones hold 8."""
    _, record = paged_beam_search(MODEL, ReferenceBackend(), tuple(range(20)), 4, 3)
    first = record[0]
    assert (first.forks, first.held_at_fork, first.clones) == (3, 2, 8)
    assert (first.copies, first.held) == (3, 5)  # the shared partial block, copied 3 times


def test_beam_search_on_the_torch_backend() -> None:
    from backend_gpu.torch_backend import TorchBackend

    found, _ = paged_beam_search(MODEL, TorchBackend(), tuple(range(20)), 3, 4)
    assert [b.tokens for b in found] == [
        b.tokens for b in contiguous_beam_search(MODEL, tuple(range(20)), 3, 4)
    ]


def test_bad_arguments_and_a_small_pool() -> None:
    with pytest.raises(ArgumentValueError, match="width"):
        paged_beam_search(MODEL, ReferenceBackend(), (1,), 0, 2)
    with pytest.raises(ArgumentValueError, match="prompt"):
        contiguous_beam_search(MODEL, (), 2, 2)
    with pytest.raises(OutOfBlocksError, match="cannot hold the beams"):
        paged_beam_search(MODEL, ReferenceBackend(), tuple(range(20)), 4, 3, num_blocks=3)


def test_the_demo_prints_blocks_and_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        code = engine_demo.main(["--beams", "4", "--backend", "reference", "--steps", "14"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "held at fork  held  full clones" in out
    assert "identical to contiguous beam search: 4/4" in out
