"""KV memory arithmetic: why contiguous reservation wastes memory and paging does not.

A Llama-3.1-8B-class model (32 layers, 8 KV heads, head dim 128, bf16) stores
K and V for every layer of every token:

>>> per_token = kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
>>> per_token // 1024                       # KiB per token
128

A request that ends at 200 tokens inside a contiguous reservation for 4,096
tokens leaves over 95% of its reservation unused:

>>> round(contiguous_waste_fraction(200, reserved_tokens=4096), 4)
0.9512
>>> contiguous_waste_fraction(200, 4096) > 0.95
True

With 16-token blocks the same request holds 13 blocks and wastes 8 slots, the
waste of a paged sequence being at most ``B - 1`` slots:

>>> blocks_for_tokens(200, block_size=16), paged_tail_waste(200, block_size=16)
(13, 8)
>>> blocks_for_tokens(20, 16), paged_tail_waste(20, 16)     # the seeds' pitfall
(2, 12)

The seeds' hybrid 27B example: only its 16 full-attention layers cache K and V
(here 4 KV heads of dim 256 in bf16), 64 KiB per token, so one sequence at the
full 262,144-token context costs 16 GiB. Its 48 linear-attention layers keep a
fixed 144 MiB float32 state per sequence instead. A 23,859 MiB pool holds one
maximum-length reservation, but ten 32,768-token sessions at 2,192 MiB each:

>>> per_token = kv_bytes_per_token(num_layers=16, num_kv_heads=4, head_dim=256, dtype_bytes=2)
>>> per_token // KIB, sequence_bytes(262_144, per_token) // GIB
(64, 16)
>>> state = 144 * MIB
>>> session = sequence_bytes(32_768, per_token, block_size=16, state_bytes=state)
>>> session // MIB, (session - state) // GIB
(2192, 2)
>>> pool = 23_859 * MIB
>>> sequences_that_fit(pool, sequence_bytes(262_144, per_token, state_bytes=state))
1
>>> sequences_that_fit(pool, session)
10
"""

from __future__ import annotations

from spec.block_manager import cdiv
from spec.errors import InvalidRequestError

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V, every layer: ``2 x layers x KV heads x head dim x bytes``."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks a paged sequence of ``num_tokens`` holds: ``ceil(t / B)``."""
    return cdiv(num_tokens, block_size)


def paged_tail_waste(num_tokens: int, block_size: int) -> int:
    """Unused slots in a paged sequence's last block (0 .. B - 1)."""
    return blocks_for_tokens(num_tokens, block_size) * block_size - num_tokens


def contiguous_waste_fraction(num_tokens: int, reserved_tokens: int) -> float:
    """Share of a contiguous reservation that a request of ``num_tokens`` leaves unused."""
    assert 0 <= num_tokens <= reserved_tokens, "the request must fit its reservation"
    return 1 - num_tokens / reserved_tokens


def paged_utilization(token_counts: list[int], block_size: int) -> float:
    """Share of the held block slots that hold real tokens, for a set of sequences.

    >>> round(paged_utilization([20, 200, 1000], block_size=16), 3)
    0.978
    """
    held = sum(blocks_for_tokens(t, block_size) for t in token_counts) * block_size
    return sum(token_counts) / held if held else 1.0


def sequence_bytes(
    num_tokens: int, bytes_per_token: int, *, block_size: int = 1, state_bytes: int = 0
) -> int:
    """Memory one sequence holds: its KV in whole blocks, plus any fixed per-sequence state.

    ``block_size=1`` is exact-length storage; a contiguous reservation is the
    same call with ``num_tokens`` set to the reserved maximum.

    >>> sequence_bytes(20, 1, block_size=16), sequence_bytes(20, 1, block_size=16, state_bytes=5)
    (32, 37)
    """
    if num_tokens < 0 or bytes_per_token < 0 or state_bytes < 0 or block_size < 1:
        raise InvalidRequestError(
            f"need num_tokens, bytes_per_token, state_bytes >= 0 and block_size >= 1; got "
            f"{num_tokens}, {bytes_per_token}, {state_bytes}, {block_size}"
        )
    return blocks_for_tokens(num_tokens, block_size) * block_size * bytes_per_token + state_bytes


def sequences_that_fit(pool_bytes: int, per_sequence_bytes: int) -> int:
    """How many sequences of ``per_sequence_bytes`` each a pool of ``pool_bytes`` holds at once."""
    if pool_bytes < 0 or per_sequence_bytes < 1:
        raise InvalidRequestError(
            f"need pool_bytes >= 0 and per_sequence_bytes >= 1; got "
            f"{pool_bytes}, {per_sequence_bytes}"
        )
    return pool_bytes // per_sequence_bytes
