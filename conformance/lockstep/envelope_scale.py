"""An envelope with its lengths and widths divided by a factor: the device envelope on a CPU.

The device envelope (:data:`conformance.lockstep.envelope.DEVICE`) draws
steps of 64 to 256 sequences and prompts of 2,048 to 32,768 tokens: hours of
float64 reference on a host. Divided by a factor, the same machinery runs
(chunked long prompts, wide mixed steps, a pool sized for them, every head
count, dim and block size of the device envelope, production shapes in
full) at a cost a CI machine pays, so ``--envelope device --scale 16``
proves it end to end on a CPU backend.

Lengths of the form ``2^k + 1`` (just past a switch point) stay just past
the scaled power of two; everything keeps a floor, so a factor too large
still draws a long prompt longer than a block and a wide step of several
sequences.

>>> from conformance.lockstep.envelope import DEVICE
>>> env = scaled(DEVICE, 16)
>>> env.wide_seqs, env.long_prompts, env.long_lengths
((4, 8, 16), (128, 2048), (128, 2048, 1025, 513, 257))
>>> env.long_chunks, env.long_pool_tokens
((128, 64, 256, 512), 4352)
>>> scaled(DEVICE, 1) is DEVICE
True
"""

from __future__ import annotations

from dataclasses import replace

from conformance.lockstep.envelope import Envelope
from spec.validate import check_int

MIN_WIDE = 4
"""The narrowest wide step a scaled envelope draws."""
MIN_LONG = 64
"""The shortest long prompt (and prefill chunk) a scaled envelope draws, in tokens."""
MIN_POOL = 1024
"""The smallest pool of a scaled long-context example, in tokens."""


def _length(n: int, factor: int) -> int:
    """``n / factor``, keeping a ``2^k + 1`` length one past the scaled power of two."""
    if n % 2 and n > 1:
        return max(MIN_LONG, (n - 1) // factor + 1)
    return max(MIN_LONG, n // factor)


def _unique(values: list[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(values))


def scaled(env: Envelope, factor: int) -> Envelope:
    """``env`` with prompt lengths, chunks, long pool and wide widths divided by ``factor``.

    Head counts, head dims, block sizes, layers and the production shapes are
    kept: they are what a kernel specialises on. ``factor`` 1 returns ``env``.
    """
    factor = check_int("envelope scale", factor, low=1)
    if factor == 1:
        return env
    lo, hi = env.long_prompts
    short, longest = _length(lo, factor), max(_length(hi, factor), _length(lo, factor))
    lengths = [min(max(_length(n, factor), short), longest) for n in env.long_lengths]
    return replace(
        env,
        wide_seqs=_unique([max(MIN_WIDE, w // factor) for w in env.wide_seqs]),
        long_prompts=(short, longest),
        long_lengths=_unique(lengths),
        long_chunks=_unique([max(MIN_LONG, c // factor) for c in env.long_chunks]),
        long_pool_tokens=max(MIN_POOL, env.long_pool_tokens // factor),
    )
