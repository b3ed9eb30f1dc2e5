"""The engine loop: schedule, execute on a backend, sample, report back.

Each step the scheduler (any :class:`spec.scheduler.Scheduler`) decides; a
:class:`StepExecutor` executes that decision on a :class:`spec.backend.Backend`
with the tiny model, in the order :class:`spec.scheduler.SchedulerOutput` prescribes:

1. swap-outs: read the victims' device blocks into the host store
   (``read_cache``), before anything this step can overwrite them;
2. copy-on-write copies (``copy_blocks``);
3. swap-ins: write the host KV back through the new slots (``write_kv``);
4. the forward pass (``write_kv`` then ``attention``, layer by layer);
5. one token per :class:`spec.scheduler.SampleSlot`, from the logits of the
   last token of its row; :class:`Engine` hands them to ``update``.

No Backend method beyond the contract is needed: swapping is reads and writes.
The same executor serves the scheduler conformance suite
(:mod:`conformance.scheduler.engine`), which drives the scheduler itself.

Beam search, where beams fork and die every step, runs the same order of
execution over the memory side directly (:mod:`paged_spec.engine.beam_search`; ``python
-m paged_spec.engine_demo --beams 4``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import numpy as np

from paged_spec.engine.tiny_model import F64, TinyModel, sample
from spec.backend import Backend
from spec.errors import ArgumentValueError
from spec.request import Request
from spec.scheduler import FinishedRequest, Scheduler, SchedulerConfig, SchedulerOutput
from spec.swap import SwapIn, SwapOut


class StepExecutor:
    """The tiny model, a backend holding its paged KV cache, and a host store for swaps.

    :meth:`execute` refuses a decision it cannot carry out (a swap naming
    blocks outside either pool, or more slots than its host blocks hold) with
    an :class:`~spec.errors.ArgumentValueError` saying which, before any of
    the step runs.
    """

    def __init__(self, model: TinyModel, backend: Backend, config: SchedulerConfig) -> None:
        self.model, self.backend = model, backend
        self.num_blocks, self.block_size = config.num_blocks, config.block_size
        self.geometry = model.geometry(config.num_blocks, config.block_size)
        backend.create_cache(self.geometry)
        mc = model.config
        shape = (config.num_host_blocks, mc.num_layers, 2, config.block_size)
        # float64 holds any cache dtype exactly
        self.host: F64 = np.zeros((*shape, mc.num_kv_heads, mc.head_dim))

    def execute(self, out: SchedulerOutput, requests: Mapping[int, Request]) -> dict[int, int]:
        """Run ``out`` end to end: one sampled token per ``out.samples`` entry, by ``seq_id``."""
        self._check_swaps(out.swap_out, out.swap_in)
        self._swap_out(out.swap_out)
        if out.batch.copies:
            self.backend.copy_blocks(out.batch.copies)
        self._swap_in(out.swap_in)
        if not out.batch.num_tokens:
            return {}
        hidden = self.model.forward_paged(out.token_ids, out.batch, self.backend)
        rows = [out.batch.query_start_loc[s.row + 1] - 1 for s in out.samples]
        logits = self.model.logits(hidden[rows])
        return {
            s.seq_id: sample(logits[i], requests[s.request_id], s.sample_index, s.position)
            for i, s in enumerate(out.samples)
        }

    # -- swapping through the contract -------------------------------------------------

    def _check_swaps(self, outs: tuple[SwapOut, ...], ins: tuple[SwapIn, ...]) -> None:
        host, b = self.host.shape[0], self.block_size
        swaps: list[SwapOut | SwapIn] = [*outs, *ins]
        for s in swaps:
            bad = [h for h in s.host_blocks if not 0 <= h < host]
            if bad:
                raise ArgumentValueError(
                    f"sequence {s.seq_id}: host blocks {bad} outside the host pool of {host}"
                )
        for o in outs:
            bad = [d for d in o.device_blocks if not 0 <= d < self.num_blocks]
            if bad:
                raise ArgumentValueError(f"swap-out of sequence {o.seq_id}: no device blocks {bad}")
            if len(o.device_blocks) != len(o.host_blocks):
                raise ArgumentValueError(
                    f"swap-out of sequence {o.seq_id}: {len(o.device_blocks)} device blocks "
                    f"to {len(o.host_blocks)} host blocks"
                )
        for i in ins:
            if len(i.slots) > len(i.host_blocks) * b:
                raise ArgumentValueError(
                    f"swap-in of sequence {i.seq_id}: {len(i.slots)} slots from "
                    f"{len(i.host_blocks)} host blocks of {b}"
                )

    def _swap_out(self, swaps: tuple[SwapOut, ...]) -> None:
        for layer in range(self.geometry.num_layers) if swaps else ():
            k, v = self.backend.read_cache(layer)
            for s in swaps:
                for dev, host in zip(s.device_blocks, s.host_blocks, strict=True):
                    self.host[host, layer, 0] = k[dev]
                    self.host[host, layer, 1] = v[dev]

    def _swap_in(self, swaps: tuple[SwapIn, ...]) -> None:
        b = self.block_size
        for s in swaps:
            pos = np.arange(len(s.slots))
            hosts = np.asarray(s.host_blocks, dtype=np.int64)[pos // b]
            for layer in range(self.geometry.num_layers):
                k = self.host[hosts, layer, 0, pos % b]
                v = self.host[hosts, layer, 1, pos % b]
                self.backend.write_kv(layer, k, v, s.slots)


class Engine:
    """A scheduler deciding steps and a :class:`StepExecutor` carrying them out."""

    def __init__(self, model: TinyModel, backend: Backend, scheduler: Scheduler) -> None:
        self.model, self.backend, self.scheduler = model, backend, scheduler
        self.executor = StepExecutor(model, backend, scheduler.config)
        self.geometry = self.executor.geometry
        self.requests: dict[int, Request] = {}
        self.finished: dict[int, FinishedRequest] = {}
        self.step_end_times: list[float] = []  # wall clock, seconds since the first step began
        self._t0: float | None = None

    def submit(self, request: Request) -> None:
        self.scheduler.submit(request)
        self.requests[request.request_id] = request

    def abort(self, request_id: int) -> None:
        """Cancel a request between steps; its blocks go back to the pool now."""
        self.scheduler.abort(request_id)
        self.finished[request_id] = self.scheduler.result(request_id)

    def step(self) -> SchedulerOutput:
        """Run one scheduler step end to end; finished requests land in :attr:`finished`."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
        out = self.scheduler.step()
        sampled = self.executor.execute(out, self.requests)
        for done in self.scheduler.update(sampled):
            self.finished[done.request_id] = done
        self.step_end_times.append(time.perf_counter() - self._t0)
        return out

    def run(
        self, requests: Iterable[Request], arrivals: Mapping[int, int] | None = None
    ) -> dict[int, FinishedRequest]:
        """Submit each request at its arrival step (default 0) and step until all finish."""
        pending = sorted(requests, key=lambda r: (arrivals or {}).get(r.request_id, 0))
        step = 0
        while pending or self.scheduler.has_unfinished():
            while pending and (arrivals or {}).get(pending[0].request_id, 0) <= step:
                self.submit(pending.pop(0))
            self.step()
            step += 1
        return self.finished
