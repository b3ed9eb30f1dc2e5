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
* preempt, by recompute or by swap: :meth:`can_swap_out`, then :meth:`preempt`;
* resume a swapped-out sequence: :meth:`can_swap_in`, then :meth:`swap_in`;
* fork a request into its samples: :meth:`fork` (it takes no blocks);
* finish or abort: :meth:`holds`, then :meth:`release`;
* lay out the step's tables and slots: :meth:`layout` (always possible);
* static batching, who fits together at their worst case: :meth:`worst_case_fit`.

Admission counts what the prefix cache supplies: the prompt's leading full
blocks that are resident are shared, not allocated, but a hit on a block that
nobody holds (cached, evictable) takes it out of the available count just
like an allocation would, so the query counts it. The first chunk of the
prompt is allocated with the admission.

How many blocks hold ``t`` tokens is one function, :func:`blocks_for`, used
by every query here. Where a token's slot is belongs to the block tables
(:func:`spec.batch.slot_of`): nothing on the scheduler side computes a slot.

**KV cache groups.** Today there is one group, full attention, over one
:class:`~spec.block_manager.BlockManager` (:data:`FULL_ATTENTION`). The calls
are shaped so that more groups (a sliding-window group, a fixed-size state
group) can sit behind them without the scheduler changing: a query becomes
the conjunction of every group's query (a request is admitted only if every
group can take it, and :meth:`check_admissible` names the group that can
never hold it); a command runs only after all the queries passed, and applies
to each group in turn, so a failure in one group changes nothing in any;
:meth:`cached_tokens` becomes the fewest tokens every group can supply.

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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from spec.batch import BatchMetadata, build_batch
from spec.block_manager import BlockManager, cdiv
from spec.errors import (
    ArgumentValueError,
    CapacityError,
    DuplicateSequenceError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from spec.prefix_cache import prompt_block_hashes
from spec.request import Request
from spec.sched_policy import SchedulerConfig
from spec.swap import HostPool, SwapIn, SwapOut
from spec.validate import check_bool, check_instance, check_int, check_positive, check_token_ids

__all__ = ["FULL_ATTENTION", "Admission", "CacheManager", "CacheUsage", "blocks_for"]

FULL_ATTENTION = "full attention"
"""The name of the one KV cache group today: paged blocks that grow with the sequence."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: the one block-count formula of the scheduler side."""
    return cdiv(num_tokens, block_size)


@dataclass(frozen=True)
class Admission:
    """What :meth:`CacheManager.admit` did: prompt tokens the cache supplied, tokens given slots."""

    cached_tokens: int
    new_tokens: int


@dataclass(frozen=True)
class CacheUsage:
    """The pool at a glance, for the per-step metrics."""

    free_blocks: int  # no holder, no cached content
    cached_blocks: int  # no holder, a reusable prefix (evictable)
    used_blocks: int  # held by some sequence (or a pending copy)
    tail_waste: int  # slots held by device sequences that hold no token
    prefix_queried_tokens: int  # cumulative
    prefix_hit_tokens: int  # cumulative


class CacheManager:
    """A scheduler's device blocks (a :class:`BlockManager`) and host blocks (a :class:`HostPool`).

    Invariant: a sequence holds device blocks (it is in :attr:`manager`),
    host blocks (it is swapped out), or nothing; never both.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = False,
    ) -> None:
        num_blocks = check_positive("num_blocks", num_blocks)
        self._block_size = check_positive("block_size", block_size)
        self._manager = BlockManager(
            num_blocks,
            self._block_size,
            enable_prefix_caching=check_bool("enable_prefix_caching", enable_prefix_caching),
        )
        self._host = HostPool(num_host_blocks)
        self._swapped: dict[int, SwapOut] = {}  # seq id -> where its KV went

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> CacheManager:
        """The memory a scheduler with ``config`` works over."""
        config = check_instance("config", config, SchedulerConfig)
        return cls(
            config.num_blocks,
            config.block_size,
            num_host_blocks=config.num_host_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
        )

    @property
    def manager(self) -> BlockManager:
        """The device group's block manager (tables, slots, integrity): read it, do not drive it."""
        return self._manager

    @property
    def host(self) -> HostPool:
        return self._host

    # -- capacity: admission control and static batching ---------------------------

    def check_admissible(self, request: Request) -> None:
        """Raise :class:`CapacityError`, naming the group, if one sample could never fit.

        One sample's worst case (every token up to ``max_new_tokens`` holding
        KV) must fit the whole pool; samples of one request can take turns.
        """
        request = check_instance("request", request, Request)
        pool = self._manager.pool
        need = blocks_for(request.max_kv_tokens, self._block_size)
        if need > pool.num_blocks:
            raise CapacityError(
                f"request {request.request_id}: KV cache group '{FULL_ATTENTION}': "
                f"{request.max_kv_tokens} tokens of KV need {need} blocks of {self._block_size}, "
                f"but the whole pool has {pool.num_blocks}"
            )

    def worst_case_fit(self, requests: Iterable[Request]) -> int:
        """How many leading ``requests`` fit the pool together at their worst case.

        Worst case: every sample reaches ``max_new_tokens`` and nothing is
        shared. A batch within that never needs to preempt.
        """
        total, fitted = 0, 0
        for request in requests:
            total += request.n * blocks_for(request.max_kv_tokens, self._block_size)
            if total > self._manager.pool.num_blocks:
                break
            fitted += 1
        return fitted

    # -- admission -----------------------------------------------------------------

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """Leading tokens the prefix cache would supply to a new sequence (a pure query)."""
        return self._manager.cached_prefix(check_token_ids("tokens", tokens))

    def can_admit(self, tokens: Sequence[int], chunk_limit: int) -> bool:
        """Could a new sequence take its prefix hits and slots for its first chunk now?

        The first chunk is ``min(uncached tokens, chunk_limit)`` tokens.
        """
        tokens = check_token_ids("tokens", tokens)
        return self._admission_cost(tokens, check_positive("chunk_limit", chunk_limit)) <= (
            self._manager.pool.num_available
        )

    def admit(self, seq_id: int, tokens: Sequence[int], chunk_limit: int) -> Admission:
        """Start sequence ``seq_id``: share its cached prefix, give slots to its first chunk."""
        seq_id = check_int("seq_id", seq_id, low=0)
        if self.holds(seq_id):
            raise DuplicateSequenceError(f"seq_id {seq_id} already holds memory")
        if not self.can_admit(tokens, chunk_limit):
            raise OutOfBlocksError(f"sequence {seq_id}: too few blocks to admit it now")
        tokens = check_token_ids("tokens", tokens)
        cached = self._manager.add_sequence(seq_id, tokens)
        num_new = min(len(tokens) - cached, chunk_limit)
        self._manager.append_slots(seq_id, tokens[cached : cached + num_new])
        return Admission(cached, num_new)

    def _admission_cost(self, tokens: Sequence[int], chunk_limit: int) -> int:
        """Available blocks admission would consume: evictable prefix hits plus fresh blocks."""
        b, pool = self._block_size, self._manager.pool
        cached = self._manager.cached_prefix(tokens)
        evictable = 0
        for h in prompt_block_hashes(tokens, b)[: cached // b] if cached else []:
            block = pool.cached_block(h)
            evictable += block is not None and pool.ref_count(block) == 0
        num_new = min(len(tokens) - cached, chunk_limit)
        return evictable + blocks_for(cached + num_new, b) - blocks_for(cached, b)

    # -- growth ----------------------------------------------------------------------

    def can_grow(self, seq_id: int, num_new: int) -> bool:
        """Could running sequence ``seq_id`` get slots for ``num_new`` more tokens now?"""
        return self._manager.can_append(seq_id, num_new)  # the manager checks its arguments

    def grow(self, seq_id: int, tokens: Sequence[int]) -> list[int]:
        """Give slots to the next ``tokens`` of a running sequence (copy-on-write first)."""
        return self._manager.append_slots(seq_id, tokens)

    # -- preemption and resumption ------------------------------------------------------

    def can_swap_out(self, seq_id: int) -> bool:
        """Does the host pool have room for every block of running sequence ``seq_id``?"""
        return len(self._manager.block_table(seq_id)) <= self._host.num_free

    def preempt(self, seq_id: int, *, swap: bool) -> SwapOut | None:
        """Take a running sequence's device blocks back now: to the host if ``swap``, else dropped.

        By swap, returns the :class:`SwapOut` the engine executes (device
        blocks to host blocks, before anything else in the step); by recompute,
        returns None and the sequence will recompute its tokens later.
        """
        table = self._manager.block_table(seq_id)
        if not check_bool("swap", swap):
            self._manager.free(seq_id)
            return None
        if not self.can_swap_out(seq_id):
            free = self._host.num_free
            raise OutOfBlocksError(
                f"host pool: sequence {seq_id} needs {len(table)} blocks, {free} free"
            )
        host = tuple(self._host.allocate(len(table)))
        out = SwapOut(seq_id, table, host, self._manager.num_tokens(seq_id))
        self._manager.free(seq_id)
        self._swapped[seq_id] = out
        return out

    def can_swap_in(self, seq_id: int, num_new: int) -> bool:
        """Could swapped-out ``seq_id`` come back into fresh blocks, plus ``num_new`` tokens?"""
        swapped = self._swapped_out(seq_id)
        total = swapped.num_tokens + check_int("num_new", num_new, low=0)
        return blocks_for(total, self._block_size) <= self._manager.pool.num_available

    def swap_in(self, seq_id: int, tokens: Sequence[int], num_new: int) -> SwapIn:
        """Bring ``seq_id`` back: fresh blocks for its swapped tokens and ``num_new`` more.

        ``tokens`` are the sequence's tokens from the start; the first
        ``SwapOut.num_tokens`` of them come back from the host (the returned
        :class:`SwapIn` says through which slots), the next ``num_new`` are new.
        """
        swapped = self._swapped_out(seq_id)
        tokens = check_token_ids("tokens", tokens)
        n, num_new = swapped.num_tokens, check_int("num_new", num_new, low=0)
        if len(tokens) < n + num_new:
            raise ArgumentValueError(
                f"tokens of sequence {seq_id}: {n} swapped + {num_new} new needed, "
                f"got {len(tokens)}"
            )
        if not self.can_swap_in(seq_id, num_new):
            raise OutOfBlocksError(f"sequence {seq_id}: too few blocks to swap it in now")
        self._manager.add_sequence(seq_id, [])
        slots = self._manager.append_slots(seq_id, tokens[:n])
        self._manager.mark_written(seq_id)  # the swap-in writes their KV, not the batch
        self._manager.append_slots(seq_id, tokens[n : n + num_new])
        self._host.free(swapped.host_blocks)
        del self._swapped[seq_id]
        return SwapIn(seq_id, swapped.host_blocks, tuple(slots))

    def _swapped_out(self, seq_id: int) -> SwapOut:
        swapped = self._swapped.get(check_int("seq_id", seq_id, low=0))
        if swapped is None:
            raise UnknownSequenceError(f"sequence {seq_id} is not swapped out")
        return swapped

    # -- the end of a sequence ------------------------------------------------------------

    def fork(self, parent_id: int, child_id: int) -> None:
        """Start ``child_id`` sharing every block of ``parent_id`` (copy-on-write later)."""
        self._manager.fork(parent_id, child_id)

    def holds(self, seq_id: int) -> bool:
        """Does ``seq_id`` hold device or host blocks?"""
        seq_id = check_int("seq_id", seq_id, low=0)
        return seq_id in self._manager or seq_id in self._swapped

    def release(self, seq_id: int) -> None:
        """Free whatever ``seq_id`` holds, device or host (a finish, an abort)."""
        seq_id = check_int("seq_id", seq_id, low=0)
        if seq_id in self._manager:
            self._manager.free(seq_id)
        elif seq_id in self._swapped:
            self._host.free(self._swapped.pop(seq_id).host_blocks)
        else:
            raise UnknownSequenceError(f"sequence {seq_id} holds no memory")

    # -- the step's layout -----------------------------------------------------------------

    def layout(self, scheduled: Sequence[tuple[int, int]]) -> BatchMetadata:
        """The step's batch metadata for ``(seq_id, num_new_tokens)`` rows, copies included.

        The memory side lays the batch out because the block tables are its
        own (one per group, once there are groups).
        """
        return build_batch(self._manager, scheduled)

    # -- reporting and checks --------------------------------------------------------------

    def host_blocks(self, seq_id: int) -> tuple[int, ...]:
        """The host blocks a swapped-out sequence's KV sits in."""
        return self._swapped_out(seq_id).host_blocks

    def swapped_ids(self) -> list[int]:
        return list(self._swapped)

    def usage(self) -> CacheUsage:
        m, pool = self._manager, self._manager.pool
        return CacheUsage(
            free_blocks=pool.num_free,
            cached_blocks=pool.num_cached,
            used_blocks=pool.num_held,
            tail_waste=sum(m.tail_waste(s) for s in m.sequence_ids()),
            prefix_queried_tokens=m.prefix_stats.queried_tokens,
            prefix_hit_tokens=m.prefix_stats.hit_tokens,
        )

    def check_integrity(self) -> None:
        """Assert the device and host invariants, and that no sequence holds both."""
        self._manager.check_integrity()
        self._host.check_integrity([b for s in self._swapped.values() for b in s.host_blocks])
        both = set(self._swapped) & set(self._manager.sequence_ids())
        assert not both, f"sequences {sorted(both)} hold device and host blocks"
