"""The mixed-step picture is one real step: two decodes and a chunk, drawn from its own metadata."""

from __future__ import annotations

import doctest
import re

import docs_tools.mixed_step
from docs_tools.mixed_step import draw_mixed_step, mixed_step


def test_the_step_mixes_two_decodes_and_a_chunk() -> None:
    out = mixed_step()
    b = out.batch
    decodes = [i for i in range(b.num_seqs) if b.query_len(i) == 1 and b.seq_lens[i] > 1]
    chunks = [
        i for i in range(b.num_seqs) if b.query_len(i) > 1 and b.seq_lens[i] == b.query_len(i)
    ]
    assert len(decodes) == 2 and len(chunks) == 1
    assert b.num_tokens == 8  # the whole budget: 1 + 1 + 6


def test_the_picture_prints_the_batch_arrays() -> None:
    out, svg = mixed_step(), draw_mixed_step()
    shown = re.findall(r">([^<>]+)</text>", svg)
    b = out.batch
    for values in (b.slot_mapping, b.positions, out.token_ids, b.query_start_loc, b.seq_lens):
        for v in values:
            assert str(v) in shown, (v, values)
    assert "[2, PAD]" in shown  # a padded table row is drawn as padding


def test_doctests() -> None:
    result = doctest.testmod(docs_tools.mixed_step)
    assert result.attempted > 0 and result.failed == 0, result
