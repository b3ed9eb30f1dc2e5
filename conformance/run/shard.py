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

import os
import re
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class Claims:
    """Examples shared out at run time: each goes to the first of several processes to ask.

    The processes of one ``--jobs`` run (:mod:`conformance.run.parallel`)
    generate the same examples from one seed; a process runs in full the
    examples it claims and draws the others through the spec alone. A claim
    is a file named for the example (its pass, and its place in the pass's
    generation order: a pass may generate more examples than it asked for,
    so run-wide numbers could collide), created only if absent (atomic on a
    local file system): each example is claimed exactly once, and a process
    slowed by a long example leaves the next ones to the others.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     a, b = Claims(Path(folder)), Claims(Path(folder))
    ...     [a.take("0.0"), b.take("0.0"), b.take("0.1"), a.take("0.1")]
    [True, False, True, False]
    """

    folder: Path

    def take(self, example: str) -> bool:
        """Claim the example of this name; whether this process got it."""
        try:
            fd = os.open(self.folder / example, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.close(fd)
        return True
