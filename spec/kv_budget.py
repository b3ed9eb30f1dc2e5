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
"""

from __future__ import annotations

from spec.block_manager import cdiv


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
