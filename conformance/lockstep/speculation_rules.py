"""The memory rules of speculation, checked on the spec's side after each speculative operation.

Every token, drafts included, has a slot in a block of its table (the
lookahead counted every block the ``1 + k`` tokens touch), and no block from
the first not wholly verified one on carries a prefix-cache hash (a hit on it
could serve a rejected token's K/V, or one overwritten since). A planted
memory bug (:mod:`conformance.planted.speculative`) breaks one of these in the
block manager the backend names, so a failure here is the backend's.
"""

from __future__ import annotations

from collections.abc import Sequence

from conformance.lockstep.example import Example
from spec.batch import PAD_BLOCK
from spec.block_manager import BlockManager, cdiv


def check_speculation(example: Example, managers: Sequence[BlockManager], seq_id: int) -> None:
    """The rules for ``seq_id`` in every KV cache group's manager."""
    for group, m in enumerate(managers):
        b, table, n = m.block_size, m.block_table(seq_id), m.num_tokens(seq_id)
        verified = n - m.num_drafts(seq_id)
        if len(table) < cdiv(n, b):
            example.fail(
                "memory",
                f"sequence {seq_id} (group {group}) holds {len(table)} blocks for {n} tokens "
                f"({m.num_drafts(seq_id)} of them drafts): the lookahead slots past a block "
                f"boundary have no block (it needs {cdiv(n, b)})",
            )
        for i in range(verified // b, len(table)):
            if table[i] != PAD_BLOCK and m.pool.block_hash(table[i]) is not None:
                example.fail(
                    "memory",
                    f"sequence {seq_id} (group {group}): block {table[i]} (table entry {i}) "
                    f"has a prefix-cache hash but holds tokens past the {verified} verified "
                    "ones (drafts, or rejected and overwritten)",
                )
    example.checks["speculative memory rules checked (lookahead blocks, unhashed drafts)"] += 1
