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
>>> blocks_for_tokens(20, 16), paged_tail_waste(20, 16)     # the classic pitfall
(2, 12)

A hybrid 27B example: only its 16 full-attention layers cache K and V
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

import math

from spec.errors import ArgumentValueError
from spec.validate import check_int, check_ints, check_positive

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of ``b``-sized blocks that hold ``a`` tokens.

    >>> cdiv(20, 16), cdiv(32, 16), cdiv(0, 16)
    (2, 2, 0)
    """
    return -(-a // b)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V, every layer: ``2 x layers x KV heads x head dim x bytes``; every factor >= 1."""
    sizes = {
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype_bytes": dtype_bytes,
    }
    return 2 * math.prod(check_positive(name, value) for name, value in sizes.items())


def latent_bytes_per_token(
    num_layers: int, latent_dim: int, rope_dim: int, dtype_bytes: int
) -> int:
    """One latent row every layer (multi-head latent attention): ``layers x (latent + rope) x
    bytes``, with no separate V and no per-head copies; every factor >= 1.

    >>> latent_bytes_per_token(61, latent_dim=512, rope_dim=64, dtype_bytes=2)  # DeepSeek-V3
    70272
    """
    sizes = {"num_layers": num_layers, "latent_dim": latent_dim, "rope_dim": rope_dim}
    layers, latent, rope = (check_positive(name, value) for name, value in sizes.items())
    return layers * (latent + rope) * check_positive("dtype_bytes", dtype_bytes)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks a paged sequence of ``num_tokens`` holds: ``ceil(t / B)``."""
    return cdiv(
        check_int("num_tokens", num_tokens, low=0), check_positive("block_size", block_size)
    )


def paged_tail_waste(num_tokens: int, block_size: int) -> int:
    """Unused slots in a paged sequence's last block (0 .. B - 1)."""
    return blocks_for_tokens(num_tokens, block_size) * block_size - num_tokens


def contiguous_waste_fraction(num_tokens: int, reserved_tokens: int) -> float:
    """Share of a contiguous reservation that a request of ``num_tokens`` leaves unused."""
    reserved = check_positive("reserved_tokens", reserved_tokens)
    t = check_int("num_tokens", num_tokens, low=0)
    if t > reserved:
        raise ArgumentValueError(
            f"num_tokens must fit its reservation (<= reserved_tokens = {reserved}), got {t}"
        )
    return 1 - t / reserved


def paged_utilization(token_counts: list[int], block_size: int) -> float:
    """Share of the held block slots that hold real tokens, for a set of sequences.

    >>> round(paged_utilization([20, 200, 1000], block_size=16), 3)
    0.978
    """
    counts = check_ints("token_counts", token_counts, low=0)
    b = check_positive("block_size", block_size)
    held = sum(blocks_for_tokens(t, b) for t in counts) * b
    return sum(counts) / held if held else 1.0


def sequence_bytes(
    num_tokens: int, bytes_per_token: int, *, block_size: int = 1, state_bytes: int = 0
) -> int:
    """Memory one sequence holds: its KV in whole blocks, plus any fixed per-sequence state.

    ``block_size=1`` is exact-length storage; a contiguous reservation is the
    same call with ``num_tokens`` set to the reserved maximum.

    >>> sequence_bytes(20, 1, block_size=16), sequence_bytes(20, 1, block_size=16, state_bytes=5)
    (32, 37)
    """
    per_token = check_int("bytes_per_token", bytes_per_token, low=0)
    state = check_int("state_bytes", state_bytes, low=0)
    slots = blocks_for_tokens(num_tokens, block_size) * block_size
    return slots * per_token + state


def sequences_that_fit(pool_bytes: int, per_sequence_bytes: int) -> int:
    """How many sequences of ``per_sequence_bytes`` each a pool of ``pool_bytes`` holds at once."""
    pool = check_int("pool_bytes", pool_bytes, low=0)
    return pool // check_positive("per_sequence_bytes", per_sequence_bytes)
