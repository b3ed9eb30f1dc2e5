"""The engine loop: schedule, execute on a backend, sample, report back.

Each step the scheduler (any :class:`spec.scheduler.Scheduler`) decides; the
engine executes that decision on a :class:`spec.backend.Backend`, in the order
:class:`spec.scheduler.SchedulerOutput` prescribes:

1. swap-outs: read the victims' device blocks into the host store
   (``read_cache``), before anything this step can overwrite them;
2. copy-on-write copies (``copy_blocks``);
3. swap-ins: write the host KV back through the new slots (``write_kv``);
4. the forward pass (``write_kv`` then ``attention``, layer by layer);
5. sample one token per :class:`spec.scheduler.SampleSlot` and ``update``.

No Backend method beyond the contract is needed: swapping is reads and writes.

Beam search, where beams fork and die every step, runs the same order of
execution over the memory side directly (:mod:`paged_spec.engine.beam_search`; ``python
-m paged_spec.engine_demo --beams 4``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from paged_spec.engine.tiny_model import TinyModel, sample
from spec.backend import Backend, KVGeometry
from spec.request import Request
from spec.scheduler import FinishedRequest, Scheduler, SchedulerOutput
from spec.swap import SwapIn, SwapOut


class Engine:
    """A tiny model, a backend holding its paged KV cache, and a scheduler deciding steps."""

    def __init__(self, model: TinyModel, backend: Backend, scheduler: Scheduler) -> None:
        cfg, mc = scheduler.config, model.config
        self.model, self.backend, self.scheduler = model, backend, scheduler
        self.geometry = KVGeometry(
            num_layers=mc.num_layers,
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
        )
        backend.create_cache(self.geometry)
        shape = (
            cfg.num_host_blocks,
            mc.num_layers,
            2,
            cfg.block_size,
            mc.num_kv_heads,
            mc.head_dim,
        )
        self.host = np.zeros(shape, dtype=np.float64)  # float64 holds any cache dtype exactly
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
        self._swap_out(out.swap_out)
        if out.batch.copies:
            self.backend.copy_blocks(out.batch.copies)
        self._swap_in(out.swap_in)
        sampled: dict[int, int] = {}
        if out.batch.num_tokens:
            hidden = self.model.forward_paged(out.token_ids, out.batch, self.backend)
            rows = [out.batch.query_start_loc[s.row + 1] - 1 for s in out.samples]
            logits = self.model.logits(hidden[rows]) if rows else torch.empty(0)
            for i, s in enumerate(out.samples):
                request = self.requests[s.request_id]
                sampled[s.seq_id] = sample(logits[i], request, s.sample_index, s.position)
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

    # -- swapping through the contract -------------------------------------------------

    def _swap_out(self, swaps: tuple[SwapOut, ...]) -> None:
        if not swaps:
            return
        for layer in range(self.geometry.num_layers):
            k, v = self.backend.read_cache(layer)
            for s in swaps:
                for dev, host in zip(s.device_blocks, s.host_blocks, strict=True):
                    self.host[host, layer, 0] = k[dev]
                    self.host[host, layer, 1] = v[dev]

    def _swap_in(self, swaps: tuple[SwapIn, ...]) -> None:
        b = self.geometry.block_size
        for s in swaps:
            pos = np.arange(len(s.slots))
            hosts = np.asarray(s.host_blocks, dtype=np.int64)[pos // b]
            for layer in range(self.geometry.num_layers):
                k = self.host[hosts, layer, 0, pos % b].astype(np.float32)
                v = self.host[hosts, layer, 1, pos % b].astype(np.float32)
                self.backend.write_kv(layer, k, v, s.slots)
