"""What an attention call's launches say of the kernel path it ran: parts and head tiles.

A :class:`Reading` of one launch says how many parts the kernel split each
sequence's keys into (1: a single pass; 2 or more: split-KV, whose partial
softmaxes a second kernel merges) and how many programs it ran across the
query heads (head tiles), or nothing for a kernel that selects no path (a
merge). Each kernel family has a reader, keyed by the kernel's name
(:func:`register`): the project's own kernels are read here, from their
grid and constexprs; an adapter of another project's kernels registers its
own. A launch no reader knows is *unread*: the call's path is then not
observed, and a report says so rather than guess.

>>> from conformance.observe.launches import Launch
>>> split = Launch("_attention_kernel", "m", (4, 2, 3), {"SPLIT": True})
>>> observe([split, Launch("_merge_kernel", "m", (4, 8, 1))])
Observed(kernels=('_attention_kernel', '_merge_kernel'), parts=3, head_tiles=None, unread=())
>>> observe([Launch("their_kernel", "m", (1, 1, 1))]).unread
('their_kernel',)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from conformance.observe.launches import Launch


@dataclass(frozen=True)
class Reading:
    """One launch's path: ``parts`` each sequence's keys were split into, ``head_tiles``
    programs across the query heads (``None``: the launch says nothing of it)."""

    parts: int | None = None
    head_tiles: int | None = None


Reader = Callable[[Launch], Reading]
"""A kernel family's reader: one launch in, what it ran out."""

_READERS: dict[str, Reader] = {}


def register(kernel: str, reader: Reader) -> None:
    """Read every launch of a kernel named ``kernel`` with ``reader`` (a later one replaces it)."""
    assert kernel and callable(reader), "a kernel name and a reader"
    _READERS[kernel] = reader


def reader_for(kernel: str) -> Reader | None:
    """The reader of ``kernel``'s launches, if one is registered."""
    return _READERS.get(kernel)


@dataclass(frozen=True)
class Observed:
    """One call's launches, read: the kernels in order, the most parts any split a sequence's
    keys into and the most head tiles (``None`` when no launch said), and the kernels no
    reader knows."""

    kernels: tuple[str, ...]
    parts: int | None
    head_tiles: int | None
    unread: tuple[str, ...]

    @property
    def known(self) -> bool:
        """Whether the launches say which path the call ran (some launch read its parts)."""
        return self.parts is not None


def observe(launches: Sequence[Launch]) -> Observed:
    """The :class:`Observed` of one call's ``launches``."""
    parts: list[int] = []
    tiles: list[int] = []
    unread: list[str] = []
    for launch in launches:
        reader = reader_for(launch.kernel)
        if reader is None:
            unread.append(launch.kernel)
            continue
        got = reader(launch)
        if got.parts is not None:
            parts.append(got.parts)
        if got.head_tiles is not None:
            tiles.append(got.head_tiles)
    return Observed(
        tuple(x.kernel for x in launches),
        max(parts) if parts else None,
        max(tiles) if tiles else None,
        tuple(dict.fromkeys(unread)),
    )


def _split_parts(launch: Launch) -> int:
    """Parts of a project kernel's launch: its third grid axis when ``SPLIT`` is on, else 1."""
    return launch.grid[2] if launch.arg("SPLIT", False) else 1


def _attention(launch: Launch) -> Reading:
    """``backend_gpu.kernels.attention._attention_kernel``: grid ``(sequences x query tiles,
    KV heads, parts)``."""
    return Reading(parts=_split_parts(launch))


def _latent(launch: Launch) -> Reading:
    """``backend_gpu.kernels.latent_attention._latent_kernel``: grid ``(sequences x query
    tiles, head tiles, parts)``, ``HEADS`` query heads a head tile."""
    return Reading(parts=_split_parts(launch), head_tiles=launch.grid[1])


def _no_path(launch: Launch) -> Reading:
    """A kernel that selects no path (the split-KV merge)."""
    return Reading()


register("_attention_kernel", _attention)
register("_latent_kernel", _latent)
register("_merge_kernel", _no_path)
register("_bf16_probe", _no_path)  # backend_gpu.kernels._checks: how bfloat16 computes here
