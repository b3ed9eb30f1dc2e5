"""The memory side of the scheduler: one query and one command per decision.

The scheduler decides *who* computes; this module says whether memory allows
it, and makes it so. The scheduler never counts blocks or reads the pool: for
each decision it asks a query and, if the answer is yes, issues the matching
command, in the style of ``can_allocate`` / ``allocate``. A command whose
query says no raises and changes nothing, so a scheduler that asks first
never fails half-way through a step.

* admission control, at submission: :meth:`check_admissible` (it only refuses);
* admit a waiting sequence: :meth:`can_admit`, then :meth:`admit`;
* give a running sequence more tokens: :meth:`can_grow`, then :meth:`grow`;
  with ``num_draft = k`` the last ``k`` are drafts (lookahead slots), then
  :meth:`verify` or :meth:`rollback` (:mod:`spec.speculative`);
* preempt, by recompute or by swap: :meth:`can_swap_out`, then :meth:`preempt`;
* resume a swapped-out sequence: :meth:`can_swap_in`, then :meth:`swap_in`;
* fork a sequence (samples, beams): :meth:`can_fork`, then :meth:`fork`;
* finish or abort: :meth:`holds`, then :meth:`release`;
* lay out the step's tables and slots: :meth:`layout` (always possible);
* static batching, who fits together at their worst case: :meth:`worst_case_fit`.

Admission counts what the prefix cache supplies: the prompt's leading full
blocks that are resident are shared, not allocated, but a hit on a block that
nobody holds (cached, evictable) takes it out of the available count just
like an allocation would, so the query counts it. The first chunk of the
prompt is allocated with the admission.

How many blocks hold ``t`` tokens is one function, :func:`blocks_for`, and
each group's own arithmetic (its window, its hits) is its
:class:`~spec.block_manager.BlockManager`'s. Where a token's slot is belongs
to the block tables (:func:`spec.batch.slot_of`): nothing on the scheduler
side computes a slot.

**KV cache groups** (:mod:`spec.kv_groups`). A model's layers form groups,
each with its own lifecycle: full attention, a sliding window, fixed-size
state. Each paged group keeps its own table per sequence (a
:class:`BlockManager`); the state group keeps one slot per sequence (a
:class:`~spec.kv_groups.StateManager`). Behind every call:

* a query is the conjunction of every group's: a request is admitted only if
  every group can take it, and since the paged groups share one pool, only if
  the *sum* of what they need is available;
* a command runs only after every query passed, and applies to each group in
  turn, releases before allocations (a block a window gives back can serve
  another group in the same step), prefix hits before fresh blocks (so a
  fresh block never evicts a block another group is about to hit); so a
  failure in one group changes nothing in any;
* :meth:`check_admissible` names the group that can never take a request;
* :meth:`cached_tokens` is the longest prefix every group can supply. A
  sliding-window group needs only the blocks the first computed query sees;
  the state group supplies none (the state after a prefix is not kept), so
  a model with state layers gets no prefix hits;
* a fork shares the blocks every paged group holds (released entries stay
  released) and copies the state into a fresh slot.

**Two pools, and why.** The paged groups share one pool of ``num_blocks``
block ids, as vLLM's hybrid allocator does: a block a window releases serves
any group, and no split between groups has to be guessed in advance. One
block-id space is also what the contract has: a layer reads
``batch.tables(geometry.group_of(layer))`` over its own ``[num_blocks, ...]``
cache, one copy list serves every layer (a block id is one group's at a time,
so copying it on every layer copies that group's KV and touches pages nobody
reads), and so does one swap list. Fixed-size state cannot share those ids: a
state slot is not a block, its size has nothing to do with ``B`` tokens, and
its lifecycle differs (one per sequence from admission to finish, copied on
fork, never cached). It is a second pool, of ``num_state_slots`` slots, as
a hybrid model needs: two pools with different lifecycles.

**Bytes, exactly.** With paged groups of ``L_g`` layers, ``H_kv`` KV heads
of dimension ``D`` and ``s`` bytes an element, block ``b`` held by group
``g`` stores ``B`` tokens of K and V for each of group ``g``'s layers,
``2 * B * L_g * H_kv * D * s`` bytes. A server backs the shared pool with
``max_g L_g`` layer-arrays of ``num_blocks`` pages each (layer ``j`` of every
group in array ``j``: they never hold one block id at the same time), so the
pool costs ``num_blocks * 2 * B * max_g L_g * H_kv * D * s`` bytes, and groups
of equal size waste nothing: split a model's windowed layers into groups of
the full-attention group's size (``paged_spec.capacity`` does). The state pool
costs ``num_state_slots * state_bytes``, where ``state_bytes`` is one
sequence's state over every state layer (144 MiB for the hybrid 27B). The
host pools cost the same per block and per slot. The contract's own layout
(one array per layer, :mod:`spec.backend`) is simpler and allocates every
layer's ``num_blocks`` pages, ``sum_g L_g / max_g L_g`` times the pool: right
for tests and the reference, not what a server allocates.

>>> cache = CacheManager(num_blocks=4, block_size=4, num_host_blocks=4)
>>> cache.can_admit([1] * 10, chunk_limit=8)        # the first chunk of 8 needs 2 blocks
True
>>> cache.admit(0, [1] * 10, chunk_limit=8)
Admission(cached_tokens=0, new_tokens=8)
>>> cache.can_grow(0, 2), cache.grow(0, [1, 1])     # the prompt's last 2 tokens, a 3rd block
(True, [8, 9])
>>> swap = cache.preempt(0, swap=cache.can_swap_out(0))
>>> swap.device_blocks, swap.host_blocks, cache.usage().used_blocks
((0, 1, 2), (0, 1, 2), 0)
>>> cache.can_swap_in(0, num_new=1)                # 10 tokens back, 1 sampled since
True
>>> back = cache.swap_in(0, [1] * 10 + [7], num_new=1)
>>> back.host_blocks, back.slots[::4]               # fresh blocks 3, 2, 1 (first slots 12, 8, 4)
((0, 1, 2), (12, 8, 4))
>>> cache.release(0); cache.holds(0), cache.usage().used_blocks
(False, 0)

With a full-attention group, a sliding window of 4 tokens and a state group,
a 12-token prompt holds 3 + 3 blocks and a state slot; once it decodes, the
window gives back what its queries no longer see:

>>> hybrid = CacheManager(8, 4, groups=(FULL_ATTENTION, sliding_window(4), FIXED_STATE),
...                       num_state_slots=2)
>>> hybrid.admit(0, list(range(12)), chunk_limit=12)
Admission(cached_tokens=0, new_tokens=12)
>>> batch = hybrid.layout([(0, 12)])
>>> batch.tables(0), batch.tables(1), batch.state.slots
(((0, 1, 2),), ((3, 4, 5),), (0,))
>>> _ = hybrid.grow(0, [12]); batch = hybrid.layout([(0, 1)])   # the query at 12 sees 9..12
>>> batch.tables(0), batch.tables(1), hybrid.usage().used_blocks
(((0, 1, 2, 6),), ((-1, -1, 5, 7),), 6)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from spec.block_manager import PAD_BLOCK, PAD_SLOT, BlockManager
from spec.block_pool import BlockPool
from spec.cache_step import CacheStep
from spec.errors import (
    ArgumentValueError,
    CapacityError,
    DuplicateSequenceError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from spec.host_memory import HostMemory
from spec.kv_budget import cdiv
from spec.kv_groups import FIXED_STATE, FULL_ATTENTION, KVCacheGroup, StateManager, StatePool
from spec.kv_groups import sliding_window as sliding_window
from spec.request import Request
from spec.sched_policy import SchedulerConfig
from spec.swap import HostPool, SwapIn, SwapOut
from spec.validate import (
    as_sequence,
    check_bool,
    check_instance,
    check_int,
    check_positive,
    check_token_ids,
)

__all__ = [
    "FIXED_STATE",
    "FULL_ATTENTION",
    "Admission",
    "CacheManager",
    "CacheUsage",
    "blocks_for",
    "sliding_window",
]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: the one block-count formula of the scheduler side."""
    return cdiv(num_tokens, block_size)


@dataclass(frozen=True)
class Admission:
    """What :meth:`CacheManager.admit` did: prompt tokens the cache supplied, tokens given slots."""

    cached_tokens: int  # prompt tokens the prefix cache supplied
    new_tokens: int  # tokens given fresh slots now


@dataclass(frozen=True)
class CacheUsage:
    """The pool at a glance, for the per-step metrics."""

    free_blocks: int  # no holder, no cached content
    cached_blocks: int  # no holder, a reusable prefix (evictable)
    used_blocks: int  # held by some sequence (or a pending copy), in any group
    tail_waste: int  # slots held by device sequences that hold no token, every group
    prefix_queried_tokens: int  # cumulative
    prefix_hit_tokens: int  # cumulative


class CacheManager(CacheStep):
    """A scheduler's device memory (one block pool shared by the paged groups, a state pool)
    and host memory (a :class:`HostPool` of blocks, one of state slots).

    ``groups`` lists the model's KV cache groups (default: one full-attention
    group); the paged ones are the batch's groups ``0, 1, ...`` in order, and
    at most one is a fixed-size state group, with ``num_state_slots`` device
    slots and ``num_host_state_slots`` host slots. ``max_chunk_tokens`` is the
    most tokens a step appends to one sequence (the scheduler's token budget),
    which bounds a windowed group's worst case for admission control.

    Invariant: a sequence holds device memory in every group (it is in every
    manager, and holds a state slot), host memory (it is swapped out), or
    nothing; never a mix.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = False,
        groups: Sequence[KVCacheGroup] = (FULL_ATTENTION,),
        num_state_slots: int = 0,
        num_host_state_slots: int = 0,
        max_chunk_tokens: int | None = None,
    ) -> None:
        num_blocks = check_positive("num_blocks", num_blocks)
        self._block_size = check_positive("block_size", block_size)
        caching = check_bool("enable_prefix_caching", enable_prefix_caching)
        self._caching = caching
        self._groups = _check_groups(groups)
        self._max_chunk = None
        if max_chunk_tokens is not None:
            self._max_chunk = check_positive("max_chunk_tokens", max_chunk_tokens)
        self._pool = BlockPool(num_blocks, self._block_size)
        paged = [g for g in self._groups if g.paged]
        self._paged = paged
        self._managers = tuple(
            BlockManager(
                num_blocks,
                self._block_size,
                enable_prefix_caching=caching,
                window=g.window,
                pool=self._pool,
                group_key=None if len(paged) == 1 else i,
            )
            for i, g in enumerate(paged)
        )
        has_state = FIXED_STATE in self._groups
        slots = check_int("num_state_slots", num_state_slots, low=0)
        self._state = StateManager(StatePool(slots)) if has_state else None
        self._host = HostMemory(num_host_blocks, num_host_state_slots)

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> CacheManager:
        """The memory a scheduler with ``config`` works over."""
        config = check_instance("config", config, SchedulerConfig)
        chunk = config.max_num_batched_tokens
        if config.max_chunk_tokens is not None:
            chunk = min(chunk, config.max_chunk_tokens)
        return cls(
            config.num_blocks,
            config.block_size,
            num_host_blocks=config.num_host_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            groups=config.kv_groups or (FULL_ATTENTION,),
            num_state_slots=config.num_state_slots or 0,
            num_host_state_slots=config.num_host_state_slots,
            max_chunk_tokens=chunk,
        )

    @property
    def manager(self) -> BlockManager:
        """Group 0's block manager (tables, slots, integrity): read it, do not drive it."""
        return self._managers[0]

    @property
    def managers(self) -> tuple[BlockManager, ...]:
        """Every paged group's block manager, in batch-group order (read-only use)."""
        return self._managers

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        return self._groups

    @property
    def pool(self) -> BlockPool:
        """The block pool every paged group shares (read-only use)."""
        return self._pool

    @property
    def state(self) -> StateManager | None:
        """The state group's slots, if the model has one (read-only use)."""
        return self._state

    @property
    def host(self) -> HostPool:
        return self._host.blocks

    # -- capacity: admission control and static batching ---------------------------

    def check_admissible(self, request: Request) -> None:
        """Raise :class:`CapacityError`, naming the group, if one sample could never fit.

        One sample's worst case (every token up to ``max_new_tokens`` holding
        KV, a window's group at most its window and a step's chunk) must fit
        the whole pool, summed over the paged groups that share it; samples of
        one request can take turns. With a state group, each of the request's
        samples needs a state slot of its own at once (they run side by side).
        """
        request = check_instance("request", request, Request)
        rid, t, b = request.request_id, request.max_kv_tokens, self._block_size
        n = self._pool.num_blocks
        needs = [m.max_blocks(t, self._max_chunk) for m in self._managers]
        for group, need in zip(self._paged, needs, strict=True):
            if need > n:
                raise CapacityError(
                    f"request {rid}: KV cache group '{group.name}': {t} tokens of KV need "
                    f"{need} blocks of {b}, but the whole pool has {n}"
                )
        if sum(needs) > n:
            each = ", ".join(f"'{g.name}' {k}" for g, k in zip(self._paged, needs, strict=True))
            raise CapacityError(
                f"request {rid}: {t} tokens of KV need {sum(needs)} blocks of {b} over its KV "
                f"cache groups ({each}), but the pool they share has {n}"
            )
        if self._state is not None and request.n > self._state.pool.num_slots:
            raise CapacityError(
                f"request {rid}: KV cache group '{FIXED_STATE.name}': {request.n} samples need "
                f"{request.n} state slots, but the state pool has {self._state.pool.num_slots}"
            )

    def worst_case_fit(self, requests: Iterable[Request]) -> int:
        """How many leading ``requests`` fit the pools together at their worst case.

        Worst case: every sample reaches ``max_new_tokens`` and nothing is
        shared. A batch within that never needs to preempt.
        """
        blocks = slots = fitted = 0
        for request in requests:
            t = request.max_kv_tokens
            blocks += request.n * sum(m.max_blocks(t, self._max_chunk) for m in self._managers)
            slots += request.n
            if blocks > self._pool.num_blocks or (
                self._state is not None and slots > self._state.pool.num_slots
            ):
                break
            fitted += 1
        return fitted

    # -- admission -----------------------------------------------------------------

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """Leading tokens the prefix cache would supply to a new sequence in every group (a pure
        query): the longest prefix each group can supply, none with a state group."""
        return self._cached(check_token_ids("tokens", tokens))

    def _cached(self, tokens: tuple[int, ...]) -> int:
        if self._state is not None or not self._caching:
            return 0
        cached = self._managers[0].cached_prefix(tokens)
        while len(self._managers) > 1:
            before = cached
            for m in self._managers:
                cached = m.cached_prefix(tokens, limit=cached)
            if cached == before:
                break
        return cached

    def can_admit(self, tokens: Sequence[int], chunk_limit: int) -> bool:
        """Could a new sequence take its prefix hits and slots for its first chunk now?

        The first chunk is ``min(uncached tokens, chunk_limit)`` tokens. Every
        group must agree: the sum of the paged groups' blocks is available,
        and a state slot is free.
        """
        return self._can_admit(check_token_ids("tokens", tokens), chunk_limit)

    def _can_admit(self, tokens: tuple[int, ...], chunk_limit: int) -> bool:
        chunk_limit = check_positive("chunk_limit", chunk_limit)
        cost = self._admission_cost(tokens, chunk_limit)
        return cost <= self._pool.num_available and self._state_slot_free()

    def admit(self, seq_id: int, tokens: Sequence[int], chunk_limit: int) -> Admission:
        """Start sequence ``seq_id``: share its cached prefix, give slots to its first chunk."""
        seq_id = check_int("seq_id", seq_id, low=0)
        if self.holds(seq_id):
            raise DuplicateSequenceError(f"seq_id {seq_id} already holds memory")
        tokens = check_token_ids("tokens", tokens)
        if not self._can_admit(tokens, chunk_limit):
            raise OutOfBlocksError(f"sequence {seq_id}: too few blocks to admit it now")
        cached, num_new = self._first_chunk(tokens, chunk_limit)
        for m in self._managers:  # every group's hits first, then fresh blocks
            m.add_sequence(seq_id, tokens, max_cached=cached)
        for m in self._managers:
            m.append_slots(seq_id, tokens[cached : cached + num_new])
        if self._state is not None:
            self._state.add(seq_id)
        return Admission(cached, num_new)

    def _admission_cost(self, tokens: tuple[int, ...], chunk_limit: int) -> int:
        """Available blocks admission would consume, over every paged group."""
        cached, num_new = self._first_chunk(tokens, chunk_limit)
        return sum(m.blocks_to_admit(tokens, num_new, max_cached=cached) for m in self._managers)

    def _first_chunk(self, tokens: tuple[int, ...], chunk_limit: int) -> tuple[int, int]:
        """``(cached, new)``: the prefix every group supplies, then the tokens given slots now."""
        cached = self._cached(tokens)
        return cached, min(len(tokens) - cached, chunk_limit)

    def _state_slot_free(self) -> bool:
        """A state group, if any, has a free slot: what a new, resumed or forked sequence needs."""
        return self._state is None or self._state.pool.num_free > 0

    # -- preemption and resumption ------------------------------------------------------

    def can_swap_out(self, seq_id: int) -> bool:
        """Do the host pools have room for every block (and the state) of running ``seq_id``?"""
        held = sum(len(self._held_verified(m, seq_id)) for m in self._managers)
        return self._host.can_park(held, state=self._state is not None)

    def preempt(self, seq_id: int, *, swap: bool) -> SwapOut | None:
        """Take a running sequence's device memory back now: to the host if ``swap``, else dropped.

        By swap, returns the :class:`SwapOut` the engine executes (device
        blocks to host blocks, every group's, and the state slot, before
        anything else in the step); by recompute, returns None and the
        sequence will recompute its tokens later (its state too).

        Drafts in flight are rolled back first: only verified tokens are
        swapped (their blocks, and the state's checkpoint) or recomputed.
        """
        held = [self._held_verified(m, seq_id) for m in self._managers]
        if not check_bool("swap", swap):
            self._free_device(seq_id)
            return None
        if not self.can_swap_out(seq_id):
            need, free = sum(len(h) for h in held), self._host.blocks.num_free
            raise OutOfBlocksError(
                f"host pool: sequence {seq_id} needs {need} blocks and its state, {free} free"
            )
        if self.num_drafts(seq_id):
            self.rollback(seq_id)
        state = None if self._state is None else self._state.source(seq_id)
        released = tuple(
            len(m.block_table(seq_id)) - len(h) for m, h in zip(self._managers, held, strict=True)
        )
        out = self._host.park(seq_id, held, released, self.manager.num_tokens(seq_id), state)
        self._free_device(seq_id)
        return out

    def _held_verified(self, m: BlockManager, seq_id: int) -> tuple[int, ...]:
        """The blocks ``seq_id`` holds in ``m`` that a rollback of its drafts would keep."""
        table = m.block_table(seq_id)
        keep = blocks_for(m.num_tokens(seq_id) - m.num_drafts(seq_id), self._block_size)
        return tuple(b for b in table[:keep] if b != PAD_BLOCK)

    def can_swap_in(self, seq_id: int, num_new: int) -> bool:
        """Could swapped-out ``seq_id`` come back into fresh blocks, plus ``num_new`` tokens?"""
        parked = self._host.parked(seq_id)
        t, k = parked.out.num_tokens, check_int("num_new", num_new, low=0)
        need = sum(m.blocks_to_restore(t, k) for m in self._managers)
        return need <= self._pool.num_available and self._state_slot_free()

    def swap_in(self, seq_id: int, tokens: Sequence[int], num_new: int) -> SwapIn:
        """Bring ``seq_id`` back: fresh blocks for its swapped tokens and ``num_new`` more.

        ``tokens`` are the sequence's tokens from the start; the first
        ``SwapOut.num_tokens`` of them come back from the host (the returned
        :class:`SwapIn` says through which slots), the next ``num_new`` are new.
        A windowed group brings back only the blocks its window still needs.
        """
        parked = self._host.parked(seq_id)
        tokens = check_token_ids("tokens", tokens)
        n, num_new = parked.out.num_tokens, check_int("num_new", num_new, low=0)
        if len(tokens) < n + num_new:
            raise ArgumentValueError(
                f"tokens of sequence {seq_id}: {n} swapped + {num_new} new needed, "
                f"got {len(tokens)}"
            )
        if not self.can_swap_in(seq_id, num_new):
            raise OutOfBlocksError(f"sequence {seq_id}: too few blocks to swap it in now")
        hosts: list[int] = []
        slots: list[int] = []
        for g, m in enumerate(self._managers):
            if slots:  # each group's run starts at a host block boundary
                slots.extend([PAD_SLOT] * (-len(slots) % self._block_size))
            slots.extend(m.restore(seq_id, tokens[:n]))
            hosts.extend(parked.host_blocks[g][m.held_from(n) - parked.released[g] :])
        for m in self._managers:
            m.append_slots(seq_id, tokens[n : n + num_new])
        state = None
        if self._state is not None and parked.host_state is not None:
            state = (parked.host_state, self._state.add(seq_id))
        self._host.unpark(seq_id)
        return SwapIn(seq_id, tuple(hosts), tuple(slots), state)

    # -- forks and the end of a sequence ----------------------------------------------------

    def can_fork(self, parent_id: int) -> bool:
        """Could running ``parent_id`` fork now? Paged groups take no blocks; a state group
        needs a free slot for the child's own state."""
        if parent_id not in self.manager:
            raise UnknownSequenceError(f"parent_id {parent_id} holds no device memory")
        return self._state_slot_free()

    def fork(self, parent_id: int, child_id: int) -> None:
        """Start ``child_id`` sharing every held block of ``parent_id`` (copy-on-write later),
        with a copy of its state in a slot of its own.

        A misuse is refused before memory is asked: a parent mid-step or with
        drafts in flight raises :class:`~spec.errors.StepBoundaryError` or
        :class:`~spec.errors.SpeculationError` naming ``parent_id``, even when
        the state pool is full (its lookahead slots may be what fills it).
        """
        if self.holds(check_int("child_id", child_id, low=0)):
            raise DuplicateSequenceError(f"child_id {child_id} already holds memory")
        self.manager.check_fork(parent_id)  # every group holds the same tokens and drafts
        if not self.can_fork(parent_id):
            raise OutOfBlocksError(f"state pool: no free state slot to fork {parent_id} into")
        for m in self._managers:
            m.fork(parent_id, child_id)
        if self._state is not None:
            self._state.fork(parent_id, child_id)

    def holds(self, seq_id: int) -> bool:
        """Does ``seq_id`` hold device or host memory?"""
        seq_id = check_int("seq_id", seq_id, low=0)
        return seq_id in self.manager or seq_id in self._host

    def release(self, seq_id: int) -> None:
        """Free whatever ``seq_id`` holds, device or host (a finish, an abort)."""
        seq_id = check_int("seq_id", seq_id, low=0)
        if seq_id in self.manager:
            self._free_device(seq_id)
        elif seq_id in self._host:
            self._host.unpark(seq_id)
        else:
            raise UnknownSequenceError(f"sequence {seq_id} holds no memory")

    def _free_device(self, seq_id: int) -> None:
        for m in self._managers:
            m.free(seq_id)
        if self._state is not None:
            self._state.free(seq_id)

    # -- reporting and checks --------------------------------------------------------------

    def host_blocks(self, seq_id: int) -> tuple[int, ...]:
        """The host blocks a swapped-out sequence's KV sits in (every group's)."""
        return self._host.parked(seq_id).out.host_blocks

    def swapped_ids(self) -> list[int]:
        return self._host.ids()

    def usage(self) -> CacheUsage:
        m, pool = self.manager, self._pool
        return CacheUsage(
            free_blocks=pool.num_free,
            cached_blocks=pool.num_cached,
            used_blocks=pool.num_held,
            tail_waste=sum(g.tail_waste(s) for g in self._managers for s in g.sequence_ids()),
            prefix_queried_tokens=m.prefix_stats.queried_tokens,
            prefix_hit_tokens=m.prefix_stats.hit_tokens,
        )

    def check_integrity(self) -> None:
        """Assert the device and host invariants: every group holds the same sequences and
        tokens, each with one state slot; the shared pool's counts match every group's
        tables; no sequence holds device and host memory."""
        first = self.manager
        for i, m in enumerate(self._managers):
            m.check_integrity(others=self._managers[:i] + self._managers[i + 1 :])
            assert m.sequence_ids() == first.sequence_ids(), (
                f"group {i} holds {m.sequence_ids()}, group 0 {first.sequence_ids()}"
            )
            for s in m.sequence_ids():
                assert m.tokens(s) == first.tokens(s), f"sequence {s}: group {i} tokens differ"
        if self._state is not None:
            self._state.check_integrity(first.sequence_ids())
        self._host.check_integrity()
        both = set(self._host.ids()) & set(first.sequence_ids())
        assert not both, f"sequences {sorted(both)} hold device and host blocks"


def _check_groups(groups: object) -> tuple[KVCacheGroup, ...]:
    """The model's groups: at least one paged group, at most one state group."""
    items = as_sequence("groups", groups)
    out = tuple(check_instance(f"groups[{i}]", g, KVCacheGroup) for i, g in enumerate(items))
    if not any(g.paged for g in out):
        raise ArgumentValueError(f"groups must hold a paged group (full or window), got {out}")
    if sum(not g.paged for g in out) > 1:
        raise ArgumentValueError("groups may hold one fixed-size state group, got several")
    return out
