"""The engine loop of the scheduler suite: execute each step on a paged cache, sample, report.

An :class:`EngineExecutor` plugs into :func:`conformance.scheduler.invariants.run_checked`:
every step the scheduler decides, the executor runs that decision on the
spec's :class:`~spec.backend.ReferenceBackend` with the tiny model of
:mod:`conformance.scheduler.model`, in the order
:class:`spec.scheduler.SchedulerOutput` prescribes:

1. swap-outs: read the victims' device blocks into a host store
   (``read_cache``), before anything this step can overwrite them;
2. copy-on-write copies (``copy_blocks``);
3. swap-ins: write the host KV back through the new slots (``write_kv``);
4. the forward pass (``write_kv`` then ``attention``, layer by layer);
5. one token per :class:`spec.scheduler.SampleSlot`, from the logits of the
   last token of its row.

At the end the checker compares every sample with the same model run alone
(:func:`~conformance.scheduler.model.generate_alone`): token-exact equivalence.

A scheduler that cannot drive a real engine (one that only costs batches for a
simulator, say) says so with a class attribute ``engine_loop_unsupported =
"why"``; the suite then reports the equivalence check as skipped, with that reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from conformance.scheduler.model import F64, MODEL, generate_alone, sample
from spec.backend import ReferenceBackend
from spec.request import Request
from spec.scheduler import Scheduler, SchedulerOutput
from spec.swap import SwapIn, SwapOut

EQUIVALENCE = "token-exact equivalence"
"""The rule an engine run checks at the end (and the name its report uses)."""


def engine_unsupported(scheduler: Scheduler) -> str | None:
    """Why ``scheduler`` cannot drive the engine loop (its own word), or None if it can."""
    why = getattr(scheduler, "engine_loop_unsupported", None)
    return None if why is None else str(why)


@dataclass
class EngineExecutor:
    """Runs each step on a paged cache with the tiny model; see the module docstring."""

    scheduler: Scheduler
    requests: Mapping[int, Request]
    rule: str = EQUIVALENCE
    backend: ReferenceBackend = field(default_factory=ReferenceBackend)

    def __post_init__(self) -> None:
        cfg = self.scheduler.config
        geometry = MODEL.geometry(cfg.num_blocks, cfg.block_size)
        self.backend.create_cache(geometry)
        shape = (cfg.num_host_blocks, MODEL.num_layers, 2, cfg.block_size)
        self.host: F64 = np.zeros((*shape, MODEL.num_kv_heads, MODEL.head_dim))

    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        self._swap_out(out.swap_out)
        if out.batch.copies:
            self.backend.copy_blocks(out.batch.copies)
        self._swap_in(out.swap_in)
        if not out.batch.num_tokens:
            return {}
        hidden = MODEL.forward_paged(out.token_ids, out.batch, self.backend)
        rows = [out.batch.query_start_loc[s.row + 1] - 1 for s in out.samples]
        logits = MODEL.logits(hidden[rows])
        return {
            s.seq_id: sample(logits[i], self.requests[s.request_id], s.sample_index, s.position)
            for i, s in enumerate(out.samples)
        }

    def alone(self, request: Request) -> tuple[tuple[int, ...], ...]:
        return tuple(generate_alone(request, i) for i in range(request.n))

    # -- swapping through the contract -------------------------------------------------

    def _host_blocks(self, seq_id: int, blocks: tuple[int, ...]) -> None:
        bad = [h for h in blocks if not 0 <= h < self.host.shape[0]]
        if bad:
            raise ValueError(
                f"sequence {seq_id}: host blocks {bad} outside the host pool of "
                f"{self.host.shape[0]}"
            )

    def _swap_out(self, swaps: tuple[SwapOut, ...]) -> None:
        num_blocks = self.scheduler.config.num_blocks
        for s in swaps:
            self._host_blocks(s.seq_id, s.host_blocks)
            bad = [d for d in s.device_blocks if not 0 <= d < num_blocks]
            if bad:
                raise ValueError(f"swap-out of sequence {s.seq_id}: no device blocks {bad}")
            if len(s.device_blocks) != len(s.host_blocks):
                raise ValueError(
                    f"swap-out of sequence {s.seq_id}: {len(s.device_blocks)} device blocks "
                    f"to {len(s.host_blocks)} host blocks"
                )
        for layer in range(MODEL.num_layers) if swaps else ():
            k, v = self.backend.read_cache(layer)
            for s in swaps:
                for dev, host in zip(s.device_blocks, s.host_blocks, strict=True):
                    self.host[host, layer, 0] = k[dev]
                    self.host[host, layer, 1] = v[dev]

    def _swap_in(self, swaps: tuple[SwapIn, ...]) -> None:
        b = self.scheduler.config.block_size
        for s in swaps:
            self._host_blocks(s.seq_id, s.host_blocks)
            if len(s.slots) > len(s.host_blocks) * b:
                raise ValueError(
                    f"swap-in of sequence {s.seq_id}: {len(s.slots)} slots from "
                    f"{len(s.host_blocks)} host blocks of {b}"
                )
            pos = np.arange(len(s.slots))
            hosts = np.asarray(s.host_blocks, dtype=np.int64)[pos // b]
            for layer in range(MODEL.num_layers):
                k = self.host[hosts, layer, 0, pos % b]
                v = self.host[hosts, layer, 1, pos % b]
                self.backend.write_kv(layer, k, v, s.slots)
