"""The suite's cost per step at device-envelope shapes, numpy reference beside the fast one.

``python -m benchmarks.conformance --device-shapes [--scale N]`` runs, per kind
of step (a decode of 64 sequences at 2,048 and at 8,192 tokens of context; a
prefill chunk of 2,048 queries over 8,192 tokens), one lockstep step on the
eager torch backend (head dim 128, 32 query heads on 8 KV heads, blocks of
16, float16), judged by each oracle in turn: the spec's numpy reference
(``spec``); the fast reference reading the blocks it needs sent afresh at
every step (``sent``: what a reference on a GPU did before the resident copy,
here a host-to-host copy); the fast reference reading the spec's memory in
place (``fast``: what it does on a CPU; a pool held lazily, as every one at
full scale is, is read from a resident copy there too); and reading the
resident copy that only new K and V reach (``resident``: what it does on a
GPU, :mod:`conformance.judges.resident_kv`). Each run is a fresh child process; the
peak resident memory it prints is the child's over the timed steps (the pools
and state they start from included, the building of that state not: the peak
is reset after it); **KV sent** is what the step sent to the oracle's device.

For each it prints the backend's time (its writes, copies and attention),
the suite's own time split into **reference** (both references of the
step), **comparison** (KV and output comparisons, the backend's reads of its
cache for them, the numerics) and **bookkeeping** (the spec's block manager and
memory, ground truth, everything else), and suite / backend, per step (for a
decode, the mean of :data:`DECODES` steps). The state before the timed steps
(the prompts' prefill) is built first and not timed.

``--scale N`` divides the sequence count and every length by ``N`` (a decode
of 64 / N sequences at 2,048 / N tokens...): the full shapes cost minutes
and gigabytes with the numpy reference on a shared CPU.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.lockstep.kv_check import SWEEP_EVERY
from spec.kv_budget import cdiv

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 32, 8, 128
ORACLES = ("spec", "sent", "fast", "resident")
SETUP_TOKENS = 8192
"""Tokens a step of the (untimed) prefill that builds the state before the timed steps."""
DECODES = SWEEP_EVERY
"""Decode steps timed per decode kind (the figures are their mean): one step is too noisy, and
the lockstep compares the whole pool once every :data:`SWEEP_EVERY` steps, so that many steps
count that comparison at its share."""


@dataclass(frozen=True)
class Kind:
    """A step: ``seqs`` sequences at ``context`` tokens, the last ``queries`` of each new."""

    name: str
    seqs: int
    context: int
    queries: int

    def scaled(self, factor: int) -> Kind:
        return Kind(
            self.name,
            max(1, self.seqs // factor),
            max(2 * BLOCK, self.context // factor),
            max(1, self.queries // factor) if self.queries > 1 else 1,
        )

    def describe(self) -> str:
        what = "decode" if self.queries == 1 else f"prefill chunk of {self.queries} over"
        return f"{what} {self.seqs} x {self.context}"


KINDS = (
    Kind("decode 64 x 2K", 64, 2048, 1),
    Kind("decode 64 x 8K", 64, 8192, 1),
    Kind("prefill 2K over 8K", 1, 8192, 2048),
)


@dataclass(frozen=True)
class Split:
    """One timed step: seconds of each part, and the child's peak resident memory in bytes."""

    backend_s: float
    reference_s: float
    comparison_s: float
    total_s: float
    peak_bytes: float
    sent_bytes: float = 0.0

    @property
    def bookkeeping_s(self) -> float:
        return self.total_s - self.backend_s - self.reference_s - self.comparison_s

    @property
    def suite_s(self) -> float:
        return self.total_s - self.backend_s


class _Clock:
    """Seconds spent in the wrapped functions, by part."""

    def __init__(self) -> None:
        self.parts = {"backend": 0.0, "reference": 0.0, "comparison": 0.0}
        self.sent = 0.0  # bytes of KV sent to the oracle's device

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[part] += time.perf_counter() - start

        return timed


_READS = ("read_cache", "read_blocks")
"""Backend calls made only to compare its cache with the spec's: the suite's comparison."""


class _TimedBackend:
    """The backend with every call's time added to the clock's ``backend`` part, but the
    reads the comparison makes (:data:`_READS`), which are the suite's."""

    def __init__(self, inner: Any, clock: _Clock) -> None:
        self.inner, self.clock = inner, clock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr
        return self.clock.wrap("comparison" if name in _READS else "backend", attr)


def _patch(clock: _Clock, oracle: str) -> None:
    """Time the suite's parts and force ``oracle`` on every step (in the child only)."""
    import conformance.judges.oracle as oracle_module
    import conformance.lockstep.kv_check as kv_check
    import conformance.lockstep.output_check as output_check

    oracle_module.FAST_THRESHOLD = 1 << 62 if oracle == "spec" else 0
    if oracle == "sent":

        def sent_afresh(choice: Any, memory: Any, layer: int, batch: Any, group: int) -> Any:
            cache = oracle_module.sent_cache(choice, memory, layer, batch, group)
            clock.sent += 2 * cache.key.numel() * cache.key.element_size()
            return cache

        setattr(oracle_module, "layer_cache", sent_afresh)  # noqa: B010
    from conformance.judges.numerics import ExampleMeter

    reference = clock.wrap("reference", getattr(output_check, "reference_outputs"))  # noqa: B009
    setattr(output_check, "reference_outputs", reference)  # noqa: B010
    for module, name in (
        (output_check, "output_errors"),
        (output_check, "first_output_difference"),
        (kv_check, "first_kv_difference"),
    ):
        setattr(module, name, clock.wrap("comparison", getattr(module, name)))
    setattr(ExampleMeter, "add", clock.wrap("comparison", ExampleMeter.add))  # noqa: B010


def _child(kind: Kind, oracle: str, out: mp.Queue[Split]) -> None:
    from backend_gpu.torch_backend import TorchBackend
    from conformance.judges.oracle import OracleChoice
    from conformance.judges.resident_kv import ResidentKV
    from conformance.judges.tile_plan import DEFAULT_MEMORY_LIMIT
    from conformance.lockstep.driver import Lockstep
    from conformance.lockstep.workload import WorkloadConfig, scale_for
    from spec.backend import KVGeometry

    clock = _Clock()
    _patch(clock, oracle)
    per_seq = cdiv(kind.context + 1, BLOCK) + 1
    geometry = KVGeometry(1, kind.seqs * per_seq, BLOCK, KV_HEADS, HEAD_DIM, "float16")
    config = WorkloadConfig(geometry, HEADS, scale_for(HEAD_DIM, False), seed=1)
    choice = OracleChoice("cpu", DEFAULT_MEMORY_LIMIT, resident=oracle == "resident")
    ls = Lockstep(_TimedBackend(TorchBackend(), clock), config, oracle=choice)
    rng = np.random.default_rng(0)
    prompts = {s: [int(t) for t in rng.integers(0, 64, kind.context)] for s in range(kind.seqs)}
    done = kind.context - kind.queries
    for s, prompt in prompts.items():
        ls.add(s, prompt)
    for work in _setup_steps(prompts, done):  # the state before the timed steps: not timed
        ls.step(work)
    for part in clock.parts:
        clock.parts[part] = 0.0
    clock.sent = 0.0
    _reset_peak()
    before = ls.memory.sent_bytes if isinstance(ls.memory, ResidentKV) else 0
    steps = [[(s, p[done:]) for s, p in prompts.items()]]
    if kind.queries == 1:  # decodes: more steps of one token each, the mean per step
        steps += [[(s, [int(t)]) for s in prompts] for t in rng.integers(0, 64, DECODES - 1)]
    start = time.perf_counter()
    for work in steps:
        ls.step(work)
    n = len(steps)
    total = (time.perf_counter() - start) / n
    peak = _peak()
    p = {part: seconds / n for part, seconds in clock.parts.items()}
    sent = clock.sent + (ls.memory.sent_bytes - before if isinstance(ls.memory, ResidentKV) else 0)
    out.put(Split(p["backend"], p["reference"], p["comparison"], total, peak, sent / n))


def _setup_steps(prompts: dict[int, list[int]], done: int) -> list[list[tuple[int, list[int]]]]:
    """Steps prefilling each prompt's first ``done`` tokens, at most :data:`SETUP_TOKENS` a step,
    so that building the state (not timed) does not peak above the timed steps."""
    if done == 0:
        return []
    chunk = min(done, SETUP_TOKENS)
    per_step = max(1, SETUP_TOKENS // chunk)
    seqs = list(prompts)
    return [
        [(s, prompts[s][lo : min(lo + chunk, done)]) for s in seqs[i : i + per_step]]
        for i in range(0, len(seqs), per_step)
        for lo in range(0, done, chunk)
    ]


def _reset_peak() -> None:
    """Start this process's peak resident memory afresh (Linux: ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak() -> float:
    """This process's peak resident memory in bytes since :func:`_reset_peak`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024.0
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(kind: Kind, oracle: str) -> Split:
    """The timed step of ``kind`` judged by ``oracle`` (a decode kind's mean over
    :data:`DECODES` steps), in a fresh process."""
    ctx = mp.get_context("spawn")
    queue: mp.Queue[Split] = ctx.Queue()
    child = ctx.Process(target=_child, args=(kind, oracle, queue))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the run of {kind.describe()} judged by {oracle} failed")
    return queue.get(timeout=10)


def table(scale: int, oracles: tuple[str, ...] = ORACLES) -> list[str]:
    """The device-shapes table, one row per kind of step and oracle (markdown)."""
    lines = [
        "| step | oracle | backend s | reference s | comparison s | bookkeeping s "
        "| suite / backend | KV sent MiB | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in (k.scaled(scale) for k in KINDS):
        for oracle in oracles:
            s = measure(kind, oracle)
            lines.append(
                f"| {kind.describe()} | {oracle} | {s.backend_s:.3f} | {s.reference_s:.3f} "
                f"| {s.comparison_s:.3f} | {s.bookkeeping_s:.3f} "
                f"| {s.suite_s / max(s.backend_s, 1e-9):.2f} | {s.sent_bytes / 2**20:.1f} "
                f"| {s.peak_bytes / 2**20:.0f} |"
            )
    return lines
