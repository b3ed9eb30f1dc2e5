"""How one step's attention is split into the calls a backend accepts, and their token rows.

The lockstep and the test vectors' replay split alike (one rule, here): a
sequence whose query the backend cannot run (a prefill for a decode-only
kernel) is left out and counted as skipped, its KV still checked; without
``mixed_batches`` decodes and prefill chunks go in separate calls; no call
holds more than ``max_num_seqs`` sequences.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from spec.batch import BatchMetadata, GroupLayout
from spec.capabilities import Capabilities


def attention_calls(
    caps: Capabilities, batch: BatchMetadata, skips: Counter[str]
) -> list[list[int]]:
    """The sequences (batch rows) of each call ``caps`` accepts; the rest counted in ``skips``."""
    runnable = []
    for i in range(batch.num_seqs):
        n = batch.query_len(i)
        why = caps.query_unsupported(n, batch.seq_lens[i] - n)
        if why:
            kind = "decode" if n == 1 else "prefill chunk"
            skips[f"{kind} attention not run: {_generic(why)}; its KV was checked"] += 1
        else:
            runnable.append(i)
    kinds: list[list[int]] = [runnable]
    if not caps.mixed_batches:
        kinds = [[i for i in runnable if batch.query_len(i) == 1]]
        kinds.append([i for i in runnable if batch.query_len(i) > 1])
    width = caps.max_num_seqs or batch.num_seqs or 1
    calls = [c for k in kinds for j in range(0, len(k), width) if (c := k[j : j + width])]
    for call in calls:
        why = caps.batch_unsupported(sub_batch(batch, call))
        assert why is None, f"internal error: the suite built a refused batch: {why}"
    return calls


def token_rows(batch: BatchMetadata, seqs: Sequence[int]) -> NDArray[np.int64]:
    """The flattened token rows of the sequences ``seqs`` of ``batch``, in that order."""
    qsl = batch.query_start_loc
    parts = [np.arange(qsl[i], qsl[i + 1]) for i in seqs]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def sub_batch(batch: BatchMetadata, seqs: Sequence[int]) -> BatchMetadata:
    """The metadata of just the sequences ``seqs`` (the same object when that is all of them)."""
    if list(seqs) == list(range(batch.num_seqs)):
        return batch
    rows = token_rows(batch, seqs).tolist()
    starts = [0]
    for i in seqs:
        starts.append(starts[-1] + batch.query_len(i))
    return BatchMetadata(
        block_size=batch.block_size,
        seq_ids=tuple(batch.seq_ids[i] for i in seqs),
        query_start_loc=tuple(starts),
        seq_lens=tuple(batch.seq_lens[i] for i in seqs),
        block_tables=tuple(batch.block_tables[i] for i in seqs),
        slot_mapping=tuple(batch.slot_mapping[r] for r in rows),
        positions=tuple(batch.positions[r] for r in rows),
        extra_groups=tuple(
            GroupLayout(
                tuple(e.block_tables[i] for i in seqs), tuple(e.slot_mapping[r] for r in rows)
            )
            for e in batch.extra_groups
        ),
    )


def _generic(why: str) -> str:
    """A skip reason without the lengths of the one query, so that skips group by cause.

    >>> _generic("a query of 7 tokens (max_query_len 1)")
    'a query of N tokens (max_query_len 1)'
    """
    return re.sub(r"\b(query|context) of \d+ tokens", r"\1 of N tokens", why)
