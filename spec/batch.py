"""Batch metadata: one step's work, flattened into a single super-sequence.

Continuous batching runs prefill chunks and single-token decodes in one forward
pass. There is no padded ``[batch, max_len]`` matrix: every scheduled token of
every sequence is laid end to end, and a few small arrays tell the kernels
where each sequence's tokens begin, how long its context is, and where its KV
lives. This is the whole contract between the scheduler and a backend.

Fields, for a step with ``S`` sequences and ``T`` scheduled tokens (dtypes are
what a tensor backend should use, and what :meth:`BatchMetadata.arrays` gives):

* ``seq_ids`` (S): which sequence each row describes.
* ``query_start_loc`` (S + 1, int32): sequence ``i``'s new tokens are rows
  ``query_start_loc[i] .. query_start_loc[i + 1] - 1`` of the flattened batch.
  It starts at 0 and strictly increases: every row has at least one new token.
* ``seq_lens`` (S, int32): sequence ``i``'s context length *including* its
  new tokens. Its new tokens sit at the last ``query_len`` positions.
* ``block_tables`` (S x max_blocks, int32): each sequence's block table, padded
  with :data:`PAD_BLOCK`. What a kernel may do with the padding, and with
  memory in general, is :data:`PADDING_RULE` (the conformance suite's bounds
  check enforces exactly that sentence): it may read a padding entry, never
  use one as a block id, and never access memory outside the tensors it is given.
* ``slot_mapping`` (T, int64): the slot each new token's K and V go to.
* ``positions`` (T, int64): each new token's position in its sequence.
* ``copies`` (pairs of int): copy-on-write copies ``(src, dst)`` to execute,
  for K and V of every layer, *before* this step's KV writes.
* ``extra_groups``: for a model whose layers form several KV cache groups
  (say full-attention and sliding-window layers), the block tables and slot
  mapping of groups ``1, 2, ...``; group 0's are the fields above. A
  sliding-window group may release the blocks wholly before every query's
  window: their entries, always a prefix of the row, are :data:`PAD_BLOCK`.
* ``state`` (optional): for a model with fixed-size state layers (linear
  attention, DeltaNet, Mamba), each row's state slot and the fork copies of
  state ``(src, dst)`` to execute before the step (:class:`StateLayout`). A
  row whose first position is 0 starts from an empty state. The state lives
  with the engine, outside the backend contract (:mod:`spec.backend`).

Query token ``j`` of sequence ``i``, at position ``p = seq_len - query_len + j``,
attends to that sequence's keys at positions ``0 .. p``.

>>> from spec.block_manager import BlockManager
>>> m = BlockManager(num_blocks=8, block_size=4)
>>> _ = m.add_sequence(7, [0] * 6); _ = m.append_slots(7, [0] * 6)   # a 6-token prefill
>>> _ = m.add_sequence(9, [0] * 2); _ = m.append_slots(9, [0] * 2)
>>> batch = build_batch(m, [(7, 6), (9, 2)])
>>> batch.query_start_loc, batch.seq_lens, batch.block_tables
((0, 6, 8), (6, 2), ((0, 1), (2, -1)))
>>> batch.slot_mapping, batch.positions
((0, 1, 2, 3, 4, 5, 8, 9), (0, 1, 2, 3, 4, 5, 0, 1))
>>> _ = m.append_slots(9, [5])                                       # next step: one decode
>>> build_batch(m, [(9, 1)]).slot_mapping
(10,)
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from spec.block_manager import PAD_BLOCK as PAD_BLOCK
from spec.block_manager import BlockManager, cdiv, slot_range
from spec.errors import ArgumentTypeError, InvalidBatchError, InvalidRequestError, UnknownBlockError
from spec.validate import check_instance, check_int, is_int

if TYPE_CHECKING:  # numpy is imported where arrays are built: the layout itself needs none
    import numpy as np
    from numpy.typing import NDArray

A = TypeVar("A")
B = TypeVar("B")

PADDING_RULE = (
    "Entries of row i past ceil(seq_lens[i] / block_size) are padding and must never be "
    "dereferenced as block ids; a kernel may read them (allowed by default, flagged in strict "
    "mode), but any access outside the tensors passed to a launch is always a violation."
)
"""The contract on block-table padding and memory bounds, in one sentence.

Reading a padding entry is allowed because the entry exists (it is part of the
table the caller allocated); using it as a block id is not (:data:`PAD_BLOCK`
points before the pool). ``conformance.bounds.checker`` checks exactly this: by
default any access outside the tensors of a kernel launch, and in strict mode
reads of padding entries too.
"""


def slot_of(table: Sequence[int], position: int, block_size: int) -> int:
    """The paging formula: position ``p`` lives in slot ``table[p // B] * B + p % B``."""
    return slot_range(table, position, position + 1, block_size)[0]


def check_copies(copies: Sequence[tuple[int, int]], num_blocks: int) -> tuple[tuple[int, int], ...]:
    """A step's copy list, validated: ids of the pool, and independent of the order they run in.

    No block may be both a source and a destination, and no destination may
    repeat; otherwise the result would depend on the order of the copies.

    >>> check_copies([(1, 2), (1, 3)], num_blocks=4)    # one source, two copies: fine
    ((1, 2), (1, 3))
    >>> check_copies([(1, 2), (2, 3)], num_blocks=4)
    Traceback (most recent call last):
    ...
    spec.errors.InvalidBatchError: copies: block 2 is both a source and a destination
    """
    pairs = []
    for i, pair in enumerate(copies):
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise InvalidBatchError(f"copies[{i}] must be a (src, dst) pair, got {pair!r}")
        src, dst = (check_int(f"copies[{i}][{j}]", b) for j, b in enumerate(pair))
        for b in (src, dst):
            if not 0 <= b < num_blocks:
                raise UnknownBlockError(
                    f"copies[{i}] = ({src}, {dst}): block {b} is outside 0..{num_blocks - 1}"
                )
        pairs.append((src, dst))
    dsts = [d for _, d in pairs]
    repeated = [d for d, count in Counter(dsts).items() if count > 1]  # linear, not quadratic
    if repeated:
        raise InvalidBatchError(f"copies: destination block {min(repeated)} appears twice")
    both = set(dsts) & {s for s, _ in pairs}
    if both:
        raise InvalidBatchError(f"copies: block {min(both)} is both a source and a destination")
    return tuple(pairs)


@dataclass(frozen=True)
class GroupLayout:
    """One more KV cache group's view of a step: its block tables and the slots its layers write."""

    block_tables: tuple[tuple[int, ...], ...]  # one row per sequence, padded with PAD_BLOCK
    slot_mapping: tuple[int, ...]  # the slot of each new token, in this group


@dataclass(frozen=True)
class StateLayout:
    """Each row's fixed-size state slot, and the state copies ``(src, dst)`` forks need first."""

    slots: tuple[int, ...]  # the state slot of each batch row
    copies: tuple[tuple[int, int], ...] = ()  # fork copies of state, done before the step
    lookahead: tuple[tuple[int, ...], ...] = ()  # per row, speculative steps' state slots; ()
    # for none. A row with k drafts reads ``slots[i]`` (its checkpoint, left as it is) and writes
    # the state after its last verified token and j drafts into ``lookahead[i][j]``, j = 0..k.


@dataclass(frozen=True)
class BatchArrays(Generic[A]):
    """The batch as arrays with the contract's dtypes (numpy by default; any array type via map).

    ``block_tables`` is ``[S, W]`` with ``W >= 1`` so that even an empty batch
    has a well-formed table; ``copies`` is ``[n, 2]``. ``group_tables[g]`` and
    ``group_slots[g]`` are group ``g``'s (``g = 0`` repeats the first two).
    """

    query_start_loc: A  # int32 [S + 1]
    seq_lens: A  # int32 [S]
    block_tables: A  # int32 [S, W]
    slot_mapping: A  # int64 [T]
    positions: A  # int64 [T]
    copies: A  # int64 [n, 2]
    group_tables: tuple[A, ...]  # int32 [S, W_g], one per KV cache group
    group_slots: tuple[A, ...]  # int64 [T], one per KV cache group
    num_tokens: int  # T
    max_query_len: int  # the most new tokens of one sequence
    max_seq_len: int  # the longest context, new tokens included

    def map(self, fn: Callable[[A], B]) -> BatchArrays[B]:
        """The same batch with every array converted by ``fn`` (e.g. to device tensors)."""
        return BatchArrays(
            fn(self.query_start_loc),
            fn(self.seq_lens),
            fn(self.block_tables),
            fn(self.slot_mapping),
            fn(self.positions),
            fn(self.copies),
            tuple(fn(t) for t in self.group_tables),
            tuple(fn(s) for s in self.group_slots),
            self.num_tokens,
            self.max_query_len,
            self.max_seq_len,
        )


@dataclass(frozen=True)
class BatchMetadata:
    """The flattened layout of one step; see the module docstring for each field."""

    block_size: int  # tokens per block (B)
    seq_ids: tuple[int, ...]  # (S) the sequence of each row
    query_start_loc: tuple[int, ...]  # (S + 1) row i's new tokens: [q[i], q[i + 1])
    seq_lens: tuple[int, ...]  # (S) context length of each row, new tokens included
    block_tables: tuple[tuple[int, ...], ...]  # (S x max_blocks) group 0's tables, PAD_BLOCK-padded
    slot_mapping: tuple[int, ...]  # (T) group 0's slot for each new token's K and V
    positions: tuple[int, ...]  # (T) each new token's position in its sequence
    copies: tuple[tuple[int, int], ...] = ()  # copy-on-write (src, dst), before the KV writes
    extra_groups: tuple[GroupLayout, ...] = ()  # KV cache groups 1, 2, ...
    state: StateLayout | None = None  # state slots and copies, for fixed-size state layers
    _checked: set[tuple[int, int | None]] = field(  # memo of validate()
        default_factory=set, init=False, repr=False, compare=False
    )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    @property
    def max_query_len(self) -> int:
        return max((self.query_len(i) for i in range(self.num_seqs)), default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len <= 1

    @property
    def num_groups(self) -> int:
        """KV cache groups laid out in this batch (1 unless the model has several)."""
        return 1 + len(self.extra_groups)

    def tables(self, group: int = 0) -> tuple[tuple[int, ...], ...]:
        """Group ``group``'s block tables, one row per sequence."""
        return self.block_tables if group == 0 else self._group(group).block_tables

    def slots(self, group: int = 0) -> tuple[int, ...]:
        """Group ``group``'s slot mapping: where the layers of that group write the new tokens."""
        return self.slot_mapping if group == 0 else self._group(group).slot_mapping

    def used_blocks(self, i: int) -> int:
        """Table entries of sequence ``i`` that hold its context: ``ceil(seq_len / B)``."""
        return cdiv(self.seq_lens[i], self.block_size)

    def validate(self, num_blocks: int, *, num_state_slots: int | None = None) -> None:
        """The one check of batch metadata that every backend, the reference included, relies on.

        Shapes agree; ``query_start_loc`` starts at 0 and strictly increases;
        ``1 <= query_len <= seq_len``; positions are each sequence's last
        ``query_len``; every table row is as wide as the widest and holds its
        ``ceil(seq_len / B)`` used entries in ``0 .. num_blocks - 1`` (a
        released prefix aside), padding after; the slot mapping is what the
        paging formula gives; the copy list is valid; a ``state`` names one
        distinct slot per row (in ``0 .. num_state_slots - 1`` when that is
        given) and a valid list of state copies. Raises
        :class:`~spec.errors.InvalidBatchError` naming the first problem.
        The result is remembered per ``num_blocks``: validating again is free,
        so a backend may call it every layer. A backend on a hot path that
        trusts its scheduler may skip it.
        """
        n = check_int("num_blocks", num_blocks, low=1)
        ns = None if num_state_slots is None else check_int("num_state_slots", num_state_slots)
        if (n, ns) in self._checked:
            return
        self._check_types()
        self._check_rows()
        self._check_tokens()
        for g in range(self.num_groups):
            self._check_group(g, n)
        check_copies(self.copies, n)
        if self.state is not None:
            self._check_state(self.state, ns)
        self._checked.add((n, ns))

    @cached_property
    def _arrays(self) -> BatchArrays[NDArray[Any]]:
        import numpy as np

        tables = tuple(_table_array(self.tables(g), self.num_seqs) for g in range(self.num_groups))
        slots = tuple(np.asarray(self.slots(g), dtype=np.int64) for g in range(self.num_groups))
        return BatchArrays(
            np.asarray(self.query_start_loc, dtype=np.int32),
            np.asarray(self.seq_lens, dtype=np.int32),
            tables[0],
            slots[0],
            np.asarray(self.positions, dtype=np.int64),
            np.asarray(self.copies, dtype=np.int64).reshape(-1, 2),
            tables,
            slots,
            self.num_tokens,
            self.max_query_len,
            self.max_seq_len,
        )

    def arrays(self) -> BatchArrays[NDArray[Any]]:
        """The metadata as numpy arrays of the contract's dtypes, built once per batch."""
        return self._arrays

    # -- internals ---------------------------------------------------------------

    def _group(self, group: int) -> GroupLayout:
        if not 0 < group < self.num_groups:
            raise InvalidRequestError(f"group {group} is outside 0..{self.num_groups - 1}")
        return self.extra_groups[group - 1]

    def _check_state(self, state: object, num_slots: int | None) -> None:
        if not isinstance(state, StateLayout):
            raise InvalidBatchError(f"state must be a StateLayout, got {type(state).__name__}")
        slots = state.slots
        if len(slots) != self.num_seqs or len(set(slots)) != len(slots):
            raise InvalidBatchError(
                f"state.slots must name one distinct slot per row ({self.num_seqs}), got {slots}"
            )
        high = None if num_slots is None else num_slots - 1
        for i, x in enumerate(slots):
            check_int(f"state.slots[{i}]", x, low=0, high=high)
        self._check_lookahead(state, high)
        ids = [x for pair in state.copies for x in pair if isinstance(x, int)]
        bound = num_slots if num_slots is not None else 1 + max([*slots, *ids], default=0)
        check_copies(state.copies, max(bound, 1))

    def _check_types(self) -> None:
        """Every index field is a sequence of ints: ``True`` is not block 1, ``1.7`` not slot 1."""
        fields: list[tuple[str, object]] = [
            ("seq_ids", self.seq_ids),
            ("query_start_loc", self.query_start_loc),
            ("seq_lens", self.seq_lens),
            ("positions", self.positions),
        ]
        if not isinstance(self.extra_groups, tuple | list):
            raise InvalidBatchError(f"extra_groups must be a tuple, got {self.extra_groups!r}")
        for g, layout in enumerate(self.extra_groups, start=1):
            if not isinstance(layout, GroupLayout):
                raise InvalidBatchError(f"extra_groups[{g - 1}] must be a GroupLayout")
        for g in range(self.num_groups):
            fields.append((f"group {g} slot_mapping", self.slots(g)))
            fields.append((f"group {g} block_tables", self.tables(g)))
        for name, values in fields:
            rows = values if name.endswith("block_tables") else (values,)
            if not isinstance(rows, tuple | list):
                raise InvalidBatchError(f"{name} must be a tuple, got {rows!r}")
            for r, row in enumerate(rows):
                where = f"{name}[{r}]" if rows is values else name
                if not isinstance(row, tuple | list):
                    raise InvalidBatchError(f"{where} must be a tuple of ints, got {row!r}")
                bad = None
                if not all(type(x) is int for x in row):  # the common case at C speed
                    bad = next(((i, x) for i, x in enumerate(row) if not is_int(x)), None)
                if bad is not None:
                    raise InvalidBatchError(
                        f"{where}[{bad[0]}] must be an int, got {type(bad[1]).__name__} {bad[1]!r}"
                    )
        if not self.query_start_loc:
            raise InvalidBatchError("query_start_loc must hold at least its first entry, 0")

    def _check_lookahead(self, state: StateLayout, high: int | None) -> None:
        """One row of ``1 + k >= 2`` lookahead slots per speculating row, all distinct."""
        if state.lookahead and len(state.lookahead) != self.num_seqs:
            raise InvalidBatchError(
                f"state.lookahead must have one entry per row ({self.num_seqs}), "
                f"got {len(state.lookahead)}"
            )
        for i, row in enumerate(state.lookahead):
            if row and len(row) < 2:
                raise InvalidBatchError(f"state.lookahead[{i}] must hold 1 + k >= 2 slots: {row}")
            for j, x in enumerate(row):
                check_int(f"state.lookahead[{i}][{j}]", x, low=0, high=high)
        ahead = [x for row in state.lookahead for x in row]
        if len(set(ahead) | set(state.slots)) != len(ahead) + len(state.slots):
            raise InvalidBatchError("state.lookahead slots must be distinct, and not rows' slots")

    def _check_rows(self) -> None:
        s = self.num_seqs
        check_int("block_size", self.block_size, low=1)
        lengths = {
            "seq_lens": len(self.seq_lens),
            "query_start_loc - 1": len(self.query_start_loc) - 1,
        }
        for g in range(self.num_groups):
            lengths[f"group {g} block_tables"] = len(self.tables(g))
        wrong = {k: v for k, v in lengths.items() if v != s}
        if wrong:
            raise InvalidBatchError(f"{s} seq_ids, but {wrong}")
        if len(set(self.seq_ids)) != s:
            raise InvalidBatchError(f"a sequence appears twice in seq_ids {self.seq_ids}")
        starts = self.query_start_loc
        if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
            raise InvalidBatchError(f"query_start_loc must start at 0 and increase: {starts}")
        for i in range(s):
            if not self.query_len(i) <= self.seq_lens[i]:
                raise InvalidBatchError(
                    f"sequence {self.seq_ids[i]}: seq_len {self.seq_lens[i]} < "
                    f"its {self.query_len(i)} new tokens"
                )

    def _check_tokens(self) -> None:
        t = self.num_tokens
        for name in ("slot_mapping", "positions"):
            if len(getattr(self, name)) != t:
                raise InvalidBatchError(f"{name} has {len(getattr(self, name))} entries, not {t}")
        for i in range(self.num_seqs):
            start, end = self.query_start_loc[i], self.query_start_loc[i + 1]
            first = self.seq_lens[i] - self.query_len(i)
            if self.positions[start:end] != tuple(range(first, self.seq_lens[i])):
                raise InvalidBatchError(
                    f"sequence {self.seq_ids[i]}: positions {self.positions[start:end]} are not "
                    f"its last {self.query_len(i)} ({first}..{self.seq_lens[i] - 1})"
                )

    def _check_group(self, group: int, num_blocks: int) -> None:
        tables, slots, b = self.tables(group), self.slots(group), self.block_size
        if len(slots) != self.num_tokens:
            raise InvalidBatchError(f"group {group}: {len(slots)} slots for {self.num_tokens}")
        width = max((len(row) for row in tables), default=0)
        for i, row in enumerate(tables):
            where = f"group {group}, sequence {self.seq_ids[i]}"
            used = self.used_blocks(i)
            if len(row) != width or used > width:
                raise InvalidBatchError(
                    f"{where}: table row of {len(row)} entries (rows are {width} wide), "
                    f"needs {used}"
                )
            released = next((j for j, x in enumerate(row) if x != PAD_BLOCK), width)
            for j, block in enumerate(row):
                ok = block == PAD_BLOCK if (j >= used or j < released) else 0 <= block < num_blocks
                if not ok:
                    raise InvalidBatchError(f"{where}: table entry {j} is {block!r}")
            start = self.query_start_loc[i]
            for p in self.positions[start : self.query_start_loc[i + 1]]:
                if p // b < released:
                    raise InvalidBatchError(f"{where}: position {p} is in a released block")
                if slots[start] != slot_of(row, p, b):
                    raise InvalidBatchError(
                        f"{where}: slot_mapping[{start}] is {slots[start]}, but position {p} "
                        f"lives in slot {slot_of(row, p, b)}"
                    )
                start += 1


def _table_array(tables: Sequence[Sequence[int]], num_seqs: int) -> NDArray[np.int32]:
    import numpy as np

    width = max(1, max((len(t) for t in tables), default=0))
    rows = [list(t) + [PAD_BLOCK] * (width - len(t)) for t in tables]
    return np.asarray(rows, dtype=np.int32).reshape(num_seqs, width)


def build_batch(
    manager: BlockManager,
    scheduled: Sequence[tuple[int, int]],
    *,
    groups: Sequence[BlockManager] = (),
    state: StateLayout | None = None,
) -> BatchMetadata:
    """Lay out one step: ``scheduled`` lists ``(seq_id, num_new_tokens)``.

    The new tokens must already have slots (:meth:`BlockManager.append_slots`):
    they are each sequence's last ``num_new_tokens`` tokens, and they must be
    *all* the tokens appended since the sequence was last laid out, so that
    every token gets its KV written exactly once. Takes the manager's pending
    copy-on-write copies into the batch.

    ``groups`` are the managers of KV cache groups ``1, 2, ...`` (``manager``
    is group 0's), over the same pool and holding the same tokens; their
    tables and slots go to ``extra_groups`` and their copies join the one
    copy list (a block id names one group's block at a time, so one list,
    executed on every layer, serves every group). ``state`` is attached as is.
    """
    check_instance("manager", manager, BlockManager)
    if isinstance(groups, str | bytes) or not isinstance(groups, Sequence):
        raise InvalidRequestError(f"groups must be a sequence of BlockManagers, got {groups!r}")
    for g, m in enumerate(groups):
        check_instance(f"groups[{g}]", m, BlockManager)
    if state is not None:
        check_instance("state", state, StateLayout)
    scheduled = _check_scheduled(scheduled)
    seen: set[int] = set()
    starts, lens, positions = [0], [], []  # type: tuple[list[int], list[int], list[int]]
    managers = (manager, *groups)
    rows = [[m.layout_row(seq_id) for seq_id, _ in scheduled] for m in managers]
    for i, (seq_id, n) in enumerate(scheduled):
        if seq_id in seen:
            raise InvalidRequestError(f"sequence {seq_id} is scheduled twice in one step")
        seen.add(seq_id)
        total = rows[0][i][1]
        n = check_int(f"the number of new tokens of sequence {seq_id}", n, low=1, high=total)
        for g, group_rows in enumerate(rows):
            _, tokens, pending = group_rows[i]
            if n != pending or tokens != total:
                raise InvalidRequestError(
                    f"sequence {seq_id}: {n} new tokens scheduled, but {pending} were appended "
                    f"in group {g} since it was last laid out (each token's KV must be written "
                    "exactly once)"
                )
        starts.append(starts[-1] + n)
        lens.append(total)
        positions.extend(range(total - n, total))
    layouts = [_group_layout(r, scheduled, manager.block_size) for r in rows]
    copies = [pair for m in managers for pair in m.take_copies()]
    return BatchMetadata(
        block_size=manager.block_size,
        seq_ids=tuple(s for s, _ in scheduled),
        query_start_loc=tuple(starts),
        seq_lens=tuple(lens),
        block_tables=layouts[0].block_tables,
        slot_mapping=layouts[0].slot_mapping,
        positions=tuple(positions),
        copies=tuple(copies),
        extra_groups=tuple(layouts[1:]),
        state=state,
    )


def _check_scheduled(scheduled: object) -> list[tuple[int, int]]:
    """``scheduled`` as a list of ``(seq_id, num_new_tokens)`` pairs of ints."""
    if isinstance(scheduled, str | bytes) or not isinstance(scheduled, Sequence):
        raise ArgumentTypeError(
            f"scheduled must be a sequence of (seq_id, num_new_tokens) pairs, got {scheduled!r}"
        )
    pairs = []
    for i, pair in enumerate(scheduled):
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise ArgumentTypeError(
                f"scheduled[{i}] must be a (seq_id, num_new_tokens) pair, got {pair!r}"
            )
        pairs.append(
            (check_int(f"scheduled[{i}] seq_id", pair[0]), check_int(f"scheduled[{i}]", pair[1]))
        )
    return pairs


def _group_layout(
    rows: Sequence[tuple[tuple[int, ...], int, int]],
    scheduled: Sequence[tuple[int, int]],
    b: int,
) -> GroupLayout:
    """One group's padded tables and the slots of the scheduled tokens (already checked)."""
    tables: list[tuple[int, ...]] = []
    slots: list[int] = []
    for (table, total, _), (_, n) in zip(rows, scheduled, strict=True):
        assert len(table) == cdiv(total, b)
        tables.append(table)
        slots.extend(slot_range(table, total - n, total, b))
    width = max((len(t) for t in tables), default=0)
    return GroupLayout(tuple(t + (PAD_BLOCK,) * (width - len(t)) for t in tables), tuple(slots))
