"""Scheduling policy: the limits a scheduler works under, and who is served first.

Every sequence gets a **rank** when it is created, and the rank never changes:
the scheduler serves (admits, gives tokens to) the smallest rank first and
preempts the largest first. A rank is ``(virtual_start, arrival, sample_index)``:

* **FCFS** (``policy="fcfs"``): ``virtual_start`` is 0 for everyone, so the
  rank is the arrival order. No request is ever admitted before one that
  arrived earlier, so a request waits at most for those ahead of it.
* **Priority with aging** (``policy="priority"``): smaller ``priority`` is
  better (like Unix nice), and a request submitted at step ``t`` with
  priority ``p`` gets ``virtual_start = t + K * p``, where ``K`` is
  ``aging_steps``. Waiting ``K`` steps is worth exactly one priority level:
  priority 1 submitted at step 0 ties with priority 0 submitted at step ``K``
  (and wins the tie, having arrived first). Strict priority, without aging,
  lets a low-priority request wait forever behind a stream of better ones.

Why the rank can be fixed: every waiting request ages at the same rate, one
level per ``K`` steps, so aging never changes the order of two requests that
are both waiting. ``priority - waited / K`` compares exactly like
``t + K * p``. Queues are therefore heaps keyed once (:mod:`spec.sched_queue`)
and nothing is re-sorted as time passes. A preempted request keeps its rank,
so it is not pushed to the back by preemption.

**The bound.** A request ``r`` of priority ``p`` submitted at step ``t`` can be
overtaken (admitted first, or preempt it) only by a request of smaller rank.
A request of priority ``q`` submitted at ``t' >= t + K * (p - q)`` has
``t' + K * q >= t + K * p`` and arrived later, so it ranks behind ``r``. With
``q_best`` the best priority in use, only the requests submitted before step
:func:`overtake_horizon` ``= t + K * (p - q_best)`` can ever be ahead of ``r``:
a finite set, however fast better work keeps arriving. ``r`` then waits no
longer than an FCFS request queued behind that set. With at most ``A``
submissions per step, at most ``A * K * (p - q_best)`` requests arriving after
``r`` are ever served before it (``tests/test_scheduler_policy.py`` checks
the resulting wait under a saturating stream of better-priority arrivals).

Choosing ``K``: small ``K`` is nearly FCFS, large ``K`` nearly strict
priority, and the worst wait grows linearly with ``K`` times the priority
gap. The default, 100 steps per level, is a few seconds of decoding at 20 to
50 ms a step: enough for priorities to decide who goes first in a burst, short
enough that priority 9 is at most 900 steps' worth of later arrivals behind
priority 0.

>>> cfg = SchedulerConfig(num_blocks=8, block_size=4, policy="priority", aging_steps=10)
>>> rank(cfg, priority=2, submit_step=0, arrival=0, sample_index=0)
(20, 0, 0)
>>> rank(cfg, priority=0, submit_step=20, arrival=7, sample_index=0)   # ties: arrival decides
(20, 7, 0)
>>> overtake_horizon(cfg, priority=2, submit_step=0, best_priority=0)
20
>>> SchedulerConfig(num_blocks=8, block_size=4, enable_prefix_caching="no")
Traceback (most recent call last):
...
spec.errors.ArgumentTypeError: enable_prefix_caching must be a bool, got str 'no'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spec.errors import ArgumentValueError
from spec.kv_groups import FIXED_STATE, KVCacheGroup
from spec.validate import (
    as_sequence,
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_positive,
)

__all__ = ["Rank", "SchedulerConfig", "overtake_horizon", "rank"]

Rank = tuple[int, int, int]
"""``(virtual_start, arrival, sample_index)``: smaller is served first, larger preempted first."""

_POSITIVE = (
    "num_blocks",
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "aging_steps",
)
_NON_NEGATIVE = ("num_host_blocks", "num_speculative_tokens")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policies. Defaults are small; vLLM's are 2048 tokens and 128 sequences.

    Validated at construction (each error names the field): the sizes and
    limits are ints >= 1 (``max_chunk_tokens`` may also be None: a chunk may
    take the whole budget), ``num_host_blocks`` an int >= 0, ``policy`` and
    ``preemption`` one of their choices, ``enable_prefix_caching`` a real bool.
    A request longer than ``max_model_len`` (prompt + ``max_new_tokens``) is
    refused at submission.

    ``kv_groups`` are the model's KV cache groups (:mod:`spec.kv_groups`;
    empty: one full-attention group). With a fixed-size state group,
    ``num_state_slots`` (default ``max_num_seqs``) must be at least
    ``max_num_seqs``: every seat has a state slot, so no admission or fork
    ever waits for one; ``num_host_state_slots`` are the host's, for swapping.

    ``num_speculative_tokens`` (``k >= 0``) is the most drafts a decoding
    sequence verifies in one step (:mod:`spec.speculative`): its row then
    carries ``1 + k`` tokens, all counted in the token budget.
    """

    num_blocks: int  # blocks in the device pool
    block_size: int  # tokens per block
    max_num_batched_tokens: int = 256  # tokens computed per step, over all sequences
    max_num_seqs: int = 16  # sequences running at once (seats)
    max_model_len: int = 1024  # prompt + max_new_tokens of any one request
    max_chunk_tokens: int | None = None  # per sequence per step; None: the whole budget
    policy: Literal["fcfs", "priority"] = "fcfs"  # who goes first: arrival, or priority with aging
    preemption: Literal["recompute", "swap"] = "recompute"  # recompute the victim later, or swap it
    num_host_blocks: int = 0  # the host pool for swapping
    enable_prefix_caching: bool = False  # share resident full blocks of a prompt
    aging_steps: int = 100  # priority policy: steps of waiting worth one priority level
    kv_groups: tuple[KVCacheGroup, ...] = ()  # empty: one full-attention group
    num_state_slots: int | None = None  # with a state group; None: max_num_seqs
    num_host_state_slots: int = 0  # the host's state slots, for swapping
    num_speculative_tokens: int = 0  # drafts a decode may verify per step (spec.speculative)

    def __post_init__(self) -> None:
        values: dict[str, object] = {n: check_positive(n, getattr(self, n)) for n in _POSITIVE}
        if self.max_chunk_tokens is not None:
            values["max_chunk_tokens"] = check_positive("max_chunk_tokens", self.max_chunk_tokens)
        values["policy"] = check_choice("policy", self.policy, ("fcfs", "priority"))
        values["preemption"] = check_choice("preemption", self.preemption, ("recompute", "swap"))
        for name in _NON_NEGATIVE:
            values[name] = check_int(name, getattr(self, name), low=0)
        values["enable_prefix_caching"] = check_bool(
            "enable_prefix_caching", self.enable_prefix_caching
        )
        values.update(_memory_groups(self))
        for name, value in values.items():  # normalised: numpy ints to int, numpy bools to bool
            object.__setattr__(self, name, value)


def _memory_groups(config: SchedulerConfig) -> dict[str, object]:
    """``kv_groups`` as a tuple of groups, and the state slots they need, checked."""
    groups = tuple(
        check_instance(f"kv_groups[{i}]", g, KVCacheGroup)
        for i, g in enumerate(as_sequence("kv_groups", config.kv_groups))
    )
    seats = check_positive("max_num_seqs", config.max_num_seqs)
    slots = config.num_state_slots
    if FIXED_STATE in groups:
        slots = seats if slots is None else check_int("num_state_slots", slots, low=0)
        if slots < seats:
            raise ArgumentValueError(
                f"num_state_slots must be >= max_num_seqs ({seats}) with a fixed-size state "
                f"group, so that every seat has a state slot, got {slots}"
            )
    elif slots is not None:
        raise ArgumentValueError("num_state_slots is only for a model with a state group")
    host = check_int("num_host_state_slots", config.num_host_state_slots, low=0)
    return {"kv_groups": groups, "num_state_slots": slots, "num_host_state_slots": host}


def rank(
    config: SchedulerConfig, *, priority: int, submit_step: int, arrival: int, sample_index: int
) -> Rank:
    """The fixed rank of a sequence (see the module docstring): smaller is served first."""
    virtual = submit_step + config.aging_steps * priority if config.policy == "priority" else 0
    return (virtual, arrival, sample_index)


def overtake_horizon(
    config: SchedulerConfig, *, priority: int, submit_step: int, best_priority: int
) -> int:
    """The step from which no submission can rank ahead of this request.

    Under FCFS that is the request's own submission step; under priority it
    is ``submit_step + aging_steps * (priority - best_priority)``, where
    ``best_priority`` is the best (smallest) priority any request may have.
    """
    if config.policy == "fcfs":
        return submit_step
    return submit_step + config.aging_steps * max(0, priority - best_priority)
