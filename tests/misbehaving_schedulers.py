"""Schedulers that misbehave in the ways the scheduler suite must survive: each class is one way.

Each is the spec's :class:`~spec.scheduler.ContinuousScheduler` with one
method changed, named on the command line as
``tests/misbehaving_schedulers.py:CLASS``. They exit, crash the process, hang
(in ``step``, ``update`` or the factory), return ``None`` from ``step``, raise
a ``BaseException`` of their own, or raise ``max_num_seqs`` on the config they
were given; ``tests/test_conformance_scheduler_isolation.py`` checks that each
ends as a reported failure, never as a pass, a traceback or a silent stop.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from spec.scheduler import (
    ContinuousScheduler,
    FinishedRequest,
    SchedulerConfig,
    SchedulerOutput,
)

_LATE = 2
"""The step at which a misbehaving scheduler misbehaves (after some ordinary steps)."""


class _Late(ContinuousScheduler):
    def _step_count(self) -> int:
        """How many times ``step`` has been called, this call included."""
        self.count = getattr(self, "count", 0) + 1
        return self.count


class ExitsInStep(_Late):
    def step(self) -> SchedulerOutput:
        if self._step_count() >= _LATE:
            sys.exit(0)
        return super().step()


class ExitsHardInStep(_Late):
    def step(self) -> SchedulerOutput:
        if self._step_count() >= _LATE:
            os._exit(0)
        return super().step()


class SegfaultsInStep(_Late):
    def step(self) -> SchedulerOutput:
        if self._step_count() >= _LATE:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
            ctypes.string_at(0)
        return super().step()


MARKER_VAR = "MISBEHAVING_SCHEDULER_MARKER"
"""When set, a hanging scheduler writes its process id there first (the run is then mid-way)."""


class HangsInStep(_Late):
    def step(self) -> SchedulerOutput:
        if self._step_count() >= _LATE:
            marker = os.environ.get(MARKER_VAR)
            if marker:
                Path(marker).write_text(str(os.getpid()))
            time.sleep(3600)
        return super().step()


class HangsInUpdate(ContinuousScheduler):
    def update(self, sampled: Mapping[int, int | Sequence[int]]) -> list[FinishedRequest]:
        time.sleep(3600)
        return super().update(sampled)


class HangsInFactory(ContinuousScheduler):
    """Builds the probe at once; hangs building a scheduler for a workload."""

    def __init__(self, config: SchedulerConfig) -> None:
        if config != SchedulerConfig(num_blocks=4, block_size=4):
            time.sleep(3600)
        super().__init__(config)


class ReturnsNoneFromStep(ContinuousScheduler):
    def step(self) -> SchedulerOutput:
        super().step()
        return None  # type: ignore[return-value]


class Escapes(BaseException):
    """Not an ``Exception``: a careless ``except Exception`` would let it through."""


class RaisesBaseException(ContinuousScheduler):
    def update(self, sampled: Mapping[int, int | Sequence[int]]) -> list[FinishedRequest]:
        raise Escapes("a BaseException of the scheduler's own")


class RaisesItsOwnSeats(ContinuousScheduler):
    """Raises ``max_num_seqs`` on the config it was given, then runs by the limit it chose."""

    def __init__(self, config: SchedulerConfig) -> None:
        object.__setattr__(config, "max_num_seqs", config.max_num_seqs + 100)
        super().__init__(config)


class ReturnsIntsFromUpdate(ContinuousScheduler):
    def update(self, sampled: Mapping[int, int | Sequence[int]]) -> list[FinishedRequest]:
        super().update(sampled)
        return [5]  # type: ignore[list-item]


class ReturnsNoneFromHasUnfinished(ContinuousScheduler):
    def has_unfinished(self) -> bool:
        return None  # type: ignore[return-value]


class ReturnsOutputWithoutBatch(ContinuousScheduler):
    """A ``SchedulerOutput`` whose batch is not a ``BatchMetadata``: the checks cannot read it."""

    def step(self) -> SchedulerOutput:
        out = super().step()
        return SchedulerOutput(step=out.step, batch=None, token_ids=(), samples=())  # type: ignore[arg-type]
