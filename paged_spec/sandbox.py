"""A toy block table (block size 4), run on the spec: grow, fork, write into a shared block, free.

``python -m paged_spec.sandbox [--block-size 4] [--tokens 10] [--out DIR]``

With block size 4, growing a sequence to 10 tokens allocates 3 blocks; a fork
shares those ids and bumps their reference counts; the first write into the
shared, partly filled last block makes a copy (copy-on-write), and the other
sequence then writes in place; freeing returns what nobody holds. Every state
printed and drawn is read from :class:`spec.block_manager.BlockManager`
itself. ``--out DIR`` also writes one SVG per step (the docs' pictures are
these, at the defaults).

>>> scenes = story()
>>> [s.name for s in scenes]
['sandbox-1-grow', 'sandbox-2-fork', 'sandbox-3-write', 'sandbox-4-free']
>>> [seq.table for seq in scenes[1].state.sequences], scenes[1].state.ref_counts[:3]
([(0, 1, 2), (0, 1, 2)], (2, 2, 2))
>>> scenes[2].state.copies
((2, 3),)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from paged_spec._cli import positive_int
from paged_spec.svg import MemoryState, capture, draw_memory
from spec.block_manager import BlockManager, cdiv

__all__ = ["Scene", "describe", "main", "story"]


@dataclass(frozen=True)
class Scene:
    """One step of the story: what happened (lines of text) and the state it left."""

    name: str
    title: str
    lines: tuple[str, ...]
    state: MemoryState

    def svg(self) -> str:
        return draw_memory(self.title, [("", self.state)])


def describe(state: MemoryState) -> list[str]:
    """The state as text: each sequence's table, then every non-free block of the pool."""
    b = state.block_size
    out = []
    for seq in state.sequences:
        waste = len(seq.table) * b - len(seq.tokens)
        out.append(
            f"  {seq.label}: {len(seq.tokens)} tokens, block table {list(seq.table)}"
            f" ({waste} empty slot{'s' * (waste != 1)} in its last block)"
        )
    free = 0
    for block, ref in enumerate(state.ref_counts):
        if ref == 0:
            free += 1
            continue
        slots = list(map(str, state.contents(block))) + ["."] * (b - len(state.contents(block)))
        out.append(f"  block {block}: ref {ref}  [{' '.join(slots)}]")
    out.append(f"  {free} of {len(state.ref_counts)} blocks free")
    return out


def story(block_size: int = 4, tokens: int = 10) -> list[Scene]:
    """Run the toy on the spec and capture each step."""
    pool = 2 * cdiv(tokens, block_size) + 2
    m = BlockManager(num_blocks=pool, block_size=block_size)
    prompt = [10 + i for i in range(tokens)]
    both = {0: "seq 0", 1: "seq 1"}
    scenes = []

    grow = [f"block size {block_size}, a pool of {pool} blocks"]
    m.add_sequence(0, [])
    for position, token in enumerate(prompt):
        before = len(m.block_table(0))
        [slot] = m.append_slots(0, [token])
        table = m.block_table(0)
        new = f"   new block {table[-1]}" if len(table) > before else ""
        grow.append(f"  token {token} at position {position} -> slot {slot}{new}")
    m.take_copies()  # the step that computes these tokens is laid out: a fork may follow
    scenes.append(
        Scene(
            "sandbox-1-grow",
            f"1. Grow sequence 0 to {tokens} tokens: {len(m.block_table(0))} blocks",
            tuple(grow),
            capture(m, {0: "seq 0"}),
        )
    )

    m.fork(0, 1)
    fork = ["  fork sequence 0 into sequence 1: same block ids, every reference count + 1"]
    scenes.append(
        Scene(
            "sandbox-2-fork",
            "2. Fork: shared blocks, nothing copied",
            tuple(fork),
            capture(m, both),
        )
    )

    last = m.block_table(1)[-1]
    shared = tokens % block_size != 0
    [slot1] = m.append_slots(1, [42])
    [slot0] = m.append_slots(0, [77])
    copies = m.take_copies()
    if shared:
        write = [
            f"  seq 1 writes token 42 at position {tokens}: its last block {last} is shared and",
            f"    partly filled, so seq 1 gets a copy, block {m.block_table(1)[-1]} (slot {slot1})",
            f"  seq 0 writes token 77 at position {tokens}: block {last} is now its own, so it",
            f"    writes in place (slot {slot0})",
        ]
    else:
        write = [
            f"  seq 1 writes token 42 at position {tokens}: its last block {last} is full, so",
            f"    the token takes a fresh block, {m.block_table(1)[-1]}, and nothing is copied",
            f"  seq 0 writes token 77 at position {tokens}: a fresh block too,"
            f" {m.block_table(0)[-1]}",
        ]
    write.append(f"  copies handed to the backend for this step: {copies}")
    title = "3. The first divergent write copies the shared block" if shared else "3. Write"
    scenes.append(Scene("sandbox-3-write", title, tuple(write), capture(m, both, copies)))

    m.free(0)
    free = ["  free sequence 0: each of its blocks loses a holder; a block nobody holds is free"]
    scenes.append(
        Scene("sandbox-4-free", "4. Free sequence 0", tuple(free), capture(m, {1: "seq 1"}))
    )
    return scenes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m paged_spec.sandbox", description=__doc__.split("\n")[0]
    )
    p.add_argument("--block-size", type=positive_int, default=4)
    p.add_argument("--tokens", type=positive_int, default=10, help="tokens to grow to")
    p.add_argument("--out", type=Path, help="also write one SVG per step into this folder")
    args = p.parse_args(argv)
    if args.out:
        from conformance.errors import SetupError
        from conformance.output_files import check_output_folder

        try:
            check_output_folder(args.out, "--out")
        except SetupError as err:
            p.error(str(err))
    scenes = story(args.block_size, args.tokens)
    for scene in scenes:
        print(f"== {scene.title}")
        print("\n".join(scene.lines))
        print("\n".join(describe(scene.state)))
        print()
    if args.out:
        from conformance.output_files import write_output  # the one rule for an output path

        for scene in scenes:
            write_output(args.out / f"{scene.name}.svg", scene.svg())
        print(f"wrote {len(scenes)} pictures into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
