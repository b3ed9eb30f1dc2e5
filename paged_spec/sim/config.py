"""A simulation's configuration: everything a run depends on, recorded in ``results.json``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from paged_spec.sim.cost import GPU_PRESETS, MODEL_PRESETS
from paged_spec.sim.run import EngineConfig
from paged_spec.sim.traffic import LENGTH_PRESETS, TraceRequest, load_trace, poisson_trace
from spec.kv_budget import GIB


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulation depends on; ``results.json`` records it."""

    traffic: str = "sharegpt"  # a LENGTH_PRESETS name, or a trace file's path
    num_requests: int = 300
    rates: tuple[float, ...] = (4.0, 8.0, 16.0, 32.0, 64.0)  # the last is the main run's
    seed: int = 0
    gpu: str = "h200"
    model: str = "llama-3.1-8b"
    kv_pool_gib: float = 4.0
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 2048
    static_wait_steps: int = 300  # a static batch waits to fill this many steps at most
    member_seconds: float = 10.0  # seconds of batch membership to record for the figure
    timeline_points: int = 400

    def engine(self) -> EngineConfig:
        """The engine; a hybrid model's state slots (one per seat) come out of the pool first."""
        model = MODEL_PRESETS[self.model]
        kv_bytes = int(self.kv_pool_gib * GIB) - self.max_num_seqs * model.state_bytes
        if kv_bytes <= 0:
            raise ValueError(
                f"{self.model}: {self.max_num_seqs} state slots of {model.state_bytes:,} bytes "
                f"fill a {self.kv_pool_gib:g} GiB pool: lower --max-num-seqs"
            )
        return EngineConfig(
            gpu=GPU_PRESETS[self.gpu],
            model=model,
            pool_tokens=kv_bytes // model.kv_bytes_per_token,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            static_wait_steps=self.static_wait_steps,
        )

    def trace(self, rate: float) -> list[TraceRequest]:
        """The trace at ``rate`` requests/s: the same lengths at every rate.

        A trace file keeps its own lengths and the shape of its arrivals, stretched
        in time so that its mean rate is ``rate``.
        """
        if self.traffic in LENGTH_PRESETS:
            return poisson_trace(LENGTH_PRESETS[self.traffic], rate, self.num_requests, self.seed)
        base = load_trace(Path(self.traffic))[: self.num_requests]
        span = base[-1].arrival
        scale = len(base) / (span * rate) if span > 0 else 0.0  # the trace's rate / rate
        return [replace(r, arrival=r.arrival * scale) for r in base]
