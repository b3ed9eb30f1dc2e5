"""Prefix caching: naming a full block by everything that came before it.

A block's KV depends on its own tokens *and* on every token before them, so a
block is named by a chained hash: ``hash(parent's hash, this block's token ids,
extra keys)``. Two sequences whose first ``k`` blocks have equal hashes have
equal prefixes, so the second can point its table at the first's blocks instead
of recomputing them. Extra keys keep apart what must not be shared even with
equal tokens (a LoRA adapter, a cache salt, an image's id): they are part of
every block's hash.

Only full blocks are named: a partial block will still be written, and shared
memory must never change under a reader.

>>> h0 = block_hash(None, [1, 2, 3, 4])
>>> h1 = block_hash(h0, [5, 6, 7, 8])
>>> h1 == block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])
True
>>> h1 == block_hash(block_hash(None, [9, 2, 3, 4]), [5, 6, 7, 8])   # same block, other prefix
False
>>> block_hash(None, [1, 2, 3, 4], extra_keys=(("lora", "a"),)) == h0
False
>>> len(prompt_block_hashes(list(range(10)), block_size=4))   # 2 full blocks; 2 tokens left over
2

Token ids must be ints: ``2.0`` is not token 2, since hashing it as ``int(2.0)``
would let a prompt of floats hit another prompt's blocks.

>>> block_hash(None, [1.0, 2, 3, 4])
Traceback (most recent call last):
...
spec.errors.ArgumentTypeError: token_ids[0] must be a token id (an int), got float 1.0
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

from spec.block_pool import BlockHash
from spec.validate import check_hash, check_keys, check_positive, check_token_ids


def block_hash(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[Hashable] = ()
) -> BlockHash:
    """SHA-256 of (parent hash, token ids, extra keys), in a canonical text form.

    SHA-256 rather than Python's ``hash``: it is stable across processes and
    resistant to crafted collisions. Token ids are ints ``>= 0``, normalised to
    ``int`` (a numpy integer names the same token). ``parent`` is ``None`` for
    a prompt's first block, else a non-empty hash. Extra keys are encoded by
    ``repr``, so they should be plain values whose ``repr`` is stable, and each
    should carry its domain, e.g. ``("lora", "x")`` rather than ``"x"``, so
    that a LoRA named ``x`` and a cache salt ``x`` do not share blocks.
    """
    if parent is not None:
        check_hash("parent", parent)
    return _hash(
        parent, check_token_ids("token_ids", token_ids), check_keys("extra_keys", extra_keys)
    )


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: Sequence[Hashable] = ()
) -> list[BlockHash]:
    """The chained hashes of every *full* block of ``token_ids``, in order."""
    tokens = check_token_ids("token_ids", token_ids)
    b = check_positive("block_size", block_size)
    keys = check_keys("extra_keys", extra_keys)
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(tokens) - b + 1, b):
        parent = _hash(parent, tokens[start : start + b], keys)
        hashes.append(parent)
    return hashes


def _hash(
    parent: BlockHash | None, tokens: tuple[int, ...], extra_keys: tuple[Hashable, ...]
) -> BlockHash:
    """The hash itself, of arguments already checked."""
    encoded = repr((parent.hex() if parent else "", tokens, extra_keys))
    return hashlib.sha256(encoded.encode()).digest()
