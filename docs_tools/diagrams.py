"""The docs' diagrams, each drawn from the spec's own state: ``python -m docs_tools.diagrams``.

Every picture in ``docs/assets/diagrams/`` is one entry of :data:`DIAGRAMS`:
a function that runs the spec (a :class:`~spec.block_manager.BlockManager`,
a :class:`~spec.scheduler.ContinuousScheduler`) and draws what it holds with
``paged_spec/svg.py``. ``tests/test_diagrams.py`` renders each one again and fails
if the committed file differs; regenerate them all with
``python -m docs_tools.diagrams`` (``--out DIR`` to write elsewhere).

>>> sorted(DIAGRAMS)[:3]
['beam-width-4', 'block-table-scattered', 'fork-before-after']
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from conformance.output_files import write_output
from docs_tools.latent_block import draw_latent_block
from docs_tools.mixed_step import draw_mixed_step
from paged_spec.sandbox import story
from paged_spec.svg import StepView, capture, draw_memory, draw_schedule
from spec.block_manager import BlockManager
from spec.request import Request
from spec.scheduler import ContinuousScheduler, SchedulerConfig, StaticScheduler

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "assets" / "diagrams"


def block_table_scattered() -> str:
    """Blocks 7, 3 and 19: reuse scatters a table over the pool.

    24 other sequences fill the pool; three of them finish (7, then 3, then 19),
    and a new 10-token sequence is granted exactly the blocks they returned, in
    that order, because the free list hands out the oldest free block first.
    """
    m = BlockManager(num_blocks=24, block_size=4)
    for i in range(24):
        m.add_sequence(100 + i, [])
        m.append_slots(100 + i, [0] * 4)
    for done in (7, 3, 19):
        m.free(100 + done)
    m.add_sequence(0, [])
    m.append_slots(0, list(range(10, 20)))
    table = m.block_table(0)
    title = (
        f"A block table scattered over the pool: position 5 -> table[5 // 4] = {table[1]}"
        f" -> slot {table[1]} * 4 + 1 = {m.slot(0, 5)}"
    )
    return draw_memory(title, [("", capture(m, {0: "sequence"}))])


def fork_before_after() -> str:
    """The sandbox's fork (step 2) and its first divergent write (step 3), one above the other."""
    scenes = story()
    return draw_memory(
        "Fork, then the first divergent write",
        [
            ("before: the fork shares every block (reference count 2)", scenes[1].state),
            ("after: seq 1's write into shared block 2 copied it to block 3", scenes[2].state),
        ],
    )


def beam_width_4() -> str:
    """The classic pitfall: block size 16, a 20-token prompt, a beam of width 4, no divergence."""
    prompt = list(range(20))
    cow = BlockManager(num_blocks=16, block_size=16)
    cow.add_sequence(0, [])
    cow.append_slots(0, prompt)
    cow.take_copies()  # the prompt's step is laid out: the beam may fork
    for beam in (1, 2, 3):
        cow.fork(0, beam)
    clone = BlockManager(num_blocks=16, block_size=16)
    for beam in range(4):
        clone.add_sequence(beam, [])
        clone.append_slots(beam, prompt)
    labels = {b: f"beam {b}" for b in range(4)}
    return draw_memory(
        "A beam of width 4 over a 20-token prompt, block size 16",
        [
            (f"copy-on-write: {cow.pool.num_held} physical blocks", capture(cow, labels)),
            (f"full clone: {clone.pool.num_held} physical blocks", capture(clone, labels)),
        ],
    )


# -- the scheduler loop ---------------------------------------------------------------

LOOP_CONFIG = SchedulerConfig(num_blocks=10, block_size=4, max_num_batched_tokens=8, max_num_seqs=3)
LOOP_REQUESTS = (  # (arrival step, prompt length, tokens to generate)
    (0, 6, 4),
    (0, 3, 2),
    (1, 10, 3),
    (2, 2, 5),
    (4, 4, 2),
)


def run_loop(make: Callable[[SchedulerConfig], ContinuousScheduler]) -> list[StepView]:
    """Run :data:`LOOP_REQUESTS` through a real scheduler; record each step as a grid column.

    ``make`` builds the scheduler from :data:`LOOP_CONFIG` (a scheduler class, or a
    ``functools.partial`` of one).

    Requests join between steps at their arrival step; one sample each, so a
    request's sequence id is its submission index.
    """
    sched = make(LOOP_CONFIG)
    generated: dict[int, int] = {}
    steps: list[StepView] = []
    step = 0
    while step == 0 or sched.has_unfinished():
        for rid, (arrival, prompt, out) in enumerate(LOOP_REQUESTS):
            if arrival == step:
                sched.submit(Request(rid, tuple(range(1, prompt + 1)), max_new_tokens=out))
        result = sched.step()
        cells: dict[int, tuple[str, str]] = {}
        for rid, (arrival, _, _) in enumerate(LOOP_REQUESTS):
            if arrival <= step and rid not in _finished(steps):
                cells[rid] = ("wait", "waiting")
        for seq, k in result.scheduled:
            prompt_done = generated.get(seq, 0) > 0 and k == 1
            cells[seq] = ("decode", "decode") if prompt_done else ("prefill", f"prompt {k}")
        for seq in result.preempted:
            cells[seq] = ("preempted", "preempted")
        finished = sched.update({s.seq_id: 7 for s in result.samples})
        for s in result.samples:
            generated[s.seq_id] = generated.get(s.seq_id, 0) + 1
        admitted = tuple(
            rid
            for rid, t in sorted(sched.metrics.timelines.items())
            if t.first_scheduled_step == step
        )
        steps.append(StepView(cells, admitted, tuple(r.request_id for r in finished), _used(sched)))
        step += 1
    return steps


def _finished(steps: Sequence[StepView]) -> set[int]:
    return {rid for s in steps for rid in s.finished}


def _used(sched: ContinuousScheduler) -> int:
    return sched.metrics.steps[-1].used_blocks


def _loop_labels() -> list[str]:
    return [f"r{i}: {p}+{o} tokens" for i, (_, p, o) in enumerate(LOOP_REQUESTS)]


def scheduler_loop() -> str:
    c = LOOP_CONFIG
    return draw_schedule(
        f"Continuous batching: each step admits, runs and finishes "
        f"(budget {c.max_num_batched_tokens} tokens, {c.max_num_seqs} seats)",
        _loop_labels(),
        run_loop(ContinuousScheduler),
        c.num_blocks,
    )


STATIC_WAIT_STEPS = 3  # the static loop's timeout: r3 and r4 never fill a batch


def static_loop() -> str:
    """Static batching (request-level) on the same requests: a batch waits until it is full (here
    3 seats) or its first request has waited :data:`STATIC_WAIT_STEPS` steps, then runs to
    completion before the next one forms."""
    c = LOOP_CONFIG
    return draw_schedule(
        f"Static batching on the same requests: a batch waits to fill ({c.max_num_seqs} seats, "
        f"at most {STATIC_WAIT_STEPS} steps), then runs to completion",
        _loop_labels(),
        run_loop(partial(StaticScheduler, max_wait_steps=STATIC_WAIT_STEPS)),
        c.num_blocks,
    )


def speculative_rollback() -> str:
    """Lookahead slots for 1 + 3 tokens across a block boundary, then a verification that
    keeps one draft: the drafts-only block goes back to the pool, and the kept block still
    holds a rejected draft's K/V past the sequence's length (docs/speculative-decoding.md)."""
    m = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    m.add_sequence(0, [])
    m.append_slots(0, [11, 12, 13, 14, 15])
    m.take_copies()
    step = [16, 21, 22, 23]  # the last verified token, then three drafts
    start, needed = m.num_tokens(0), m.blocks_needed(0, len(step))
    slots = m.append_slots(0, step, num_draft=len(step) - 1)
    m.take_copies()
    before, held = capture(m, {0: "sequence 0"}), m.block_table(0)
    rejected = m.verify(0, num_accepted=1)
    kept, b = m.block_table(0), m.block_size
    freed = [x for x in held if x not in kept]
    left = [
        t for t, slot in zip(step, slots, strict=True) if slot in rejected and slot // b in kept
    ]
    after = capture(m, {0: "sequence 0"}, rejected={0: left})
    return draw_memory(
        "Speculative decoding: lookahead slots, then verification",
        [
            (
                f"the step: 1 + {len(step) - 1} tokens at p{start}..p{start + len(step) - 1}, "
                f"blocks_needed = {needed}, slots {slots}",
                before,
            ),
            (
                f"verify(num_accepted=1): {m.num_tokens(0)} tokens; block {freed[0]} back to "
                f"the pool; rejected slots {rejected}",
                after,
            ),
        ],
    )


def _sandbox(i: int) -> Callable[[], str]:
    return lambda: story()[i].svg()


DIAGRAMS: dict[str, Callable[[], str]] = {
    **{
        f"sandbox-{i + 1}-{n}": _sandbox(i) for i, n in enumerate(("grow", "fork", "write", "free"))
    },
    "block-table-scattered": block_table_scattered,
    "fork-before-after": fork_before_after,
    "beam-width-4": beam_width_4,
    "scheduler-loop": scheduler_loop,
    "static-loop": static_loop,
    "mixed-step": draw_mixed_step,
    "speculative-rollback": speculative_rollback,
    "latent-block": draw_latent_block,
}
"""File name (without ``.svg``) -> the function that draws it."""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m docs_tools.diagrams", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--out", type=Path, default=OUT, help=f"folder (default {OUT.relative_to(ROOT)})"
    )
    args = p.parse_args(argv)
    for name, draw in DIAGRAMS.items():  # by the project's one rule for an output path
        write_output(args.out / f"{name}.svg", draw())
    print(f"wrote {len(DIAGRAMS)} diagrams into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
