"""The errors the spec raises.

Every invalid operation raises one of these *before* touching any state, so a
caller that catches the error can keep using the object as if the call never
happened. The one thing a failed allocation does record is itself: the
``num_allocation_failures`` metric counts it. Each class names one kind of
misuse; the message names the offending value.
"""

from __future__ import annotations


class SpecError(Exception):
    """Base class of every error the spec raises on purpose."""


class OutOfBlocksError(SpecError):
    """The pool has no free (or evictable) block left for an allocation."""


class DoubleFreeError(SpecError):
    """A block whose reference count is already zero was released again."""


class UnknownBlockError(SpecError):
    """A block id outside ``0 .. num_blocks - 1``."""


class UnknownSequenceError(SpecError):
    """A sequence id that the manager does not hold (never added, or freed)."""


class DuplicateSequenceError(SpecError):
    """A sequence id that the manager already holds."""


class InvalidRequestError(SpecError):
    """An argument that can never be valid: a negative count, a bad shape, a bad dtype."""


class ArgumentTypeError(InvalidRequestError):
    """An argument of the wrong type: a bool or a float where an int id belongs, say."""


class ArgumentValueError(InvalidRequestError):
    """An argument of the right type but an impossible value: negative, zero, NaN, out of range."""


class BlockStateError(InvalidRequestError):
    """A block in the wrong state for the operation: sharing a free block, caching an unheld one."""


class StepBoundaryError(InvalidRequestError):
    """An operation that must wait for the end of the step's layout.

    Forking a sequence whose tokens of the current step are not laid out yet
    (:meth:`spec.block_manager.BlockManager.take_copies` marks that point), say:
    a copy runs before its step's KV writes, so it would miss them.
    """


class SpeculationError(InvalidRequestError):
    """A speculative operation out of turn (:mod:`spec.speculative`).

    Verifying or rolling back a sequence with no drafts in flight (verifying
    twice is one such call), drafting again before the last drafts are
    verified, or forking a sequence whose drafts are still in flight.
    """


class InvalidBatchError(InvalidRequestError):
    """Batch metadata that is not well formed (see :meth:`spec.batch.BatchMetadata.validate`)."""


class CapacityError(SpecError):
    """A request that can never fit, whatever else is freed (admission control)."""
