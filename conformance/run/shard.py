"""One shard of a run: every N-th generated example, so that N machines split one run.

``--shard K/N`` runs the examples whose number is ``K - 1`` modulo ``N``:
each pass's examples are numbered in the order one seed generates them,
after the examples the earlier passes asked for (so that the passes of one
example each fall to different shards). Every shard of a run
must use the same seed: the shards then generate the same sequence of
workloads, each runs its own share against the backend, and together they
run each example exactly once, whether they are a CI matrix or pytest-xdist
workers. The others' examples are still drawn, through the spec's
bookkeeping alone (no backend, no KV values, no attention), because a
Hypothesis example can only be generated after the ones before it.

>>> shard = parse_shard("2/3")
>>> shard, [i for i in range(8) if shard.owns(i)]
(Shard(index=2, count=3), [1, 4, 7])
>>> parse_shard("3/2")
Traceback (most recent call last):
...
ValueError: '3/2': the shard K/N needs 1 <= K <= N, got K=3, N=2
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SHAPE = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` (1-based) of ``count``: the examples ``i`` with ``i % count == index - 1``.

    Invariant: ``1 <= index <= count``, so the shards ``1/N .. N/N`` partition
    every sequence of examples.
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 1 <= self.index <= self.count:
            raise ValueError(f"the shard K/N needs 1 <= K <= N, got K={self.index}, N={self.count}")

    def owns(self, example: int) -> bool:
        """Whether the example of this index (0-based, in generation order) is this shard's."""
        return example % self.count == self.index - 1

    def describe(self) -> str:
        """``K/N``, as the flag takes it."""
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``K/N`` as a :class:`Shard` (also an argparse ``type``); ``ValueError`` names the problem.

    >>> parse_shard("1/1").describe()
    '1/1'
    >>> parse_shard("two/4")
    Traceback (most recent call last):
    ...
    ValueError: 'two/4' is not a shard: expected K/N with whole numbers, as 1/4
    """
    match = _SHAPE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a shard: expected K/N with whole numbers, as 1/4")
    try:
        return Shard(int(match[1]), int(match[2]))
    except ValueError as err:
        raise ValueError(f"{text!r}: {err}") from None
