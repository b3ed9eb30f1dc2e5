"""Replaying test vectors against a backend, judged exactly as the lockstep suite judges it.

Each vector's operations are handed to the backend in order, through the
suite's :class:`~conformance.judges.guard.CallGuard` (read-only inputs, faults
reported, not raised). Reads of the cache are compared bit for bit with the
expected image (:func:`conformance.judges.compare.first_kv_difference`); each
attention output beside its same-precision reference
(:func:`conformance.judges.numerics.output_errors`, then
:func:`~conformance.judges.compare.first_output_difference`); at the end of the
vector, its mean error and bias (:class:`~conformance.judges.numerics.ExampleMeter`).
A step's outputs are judged after its reads, as the lockstep judges them (a
wrong cache is the usual root cause of a wrong output). The first difference
raises :class:`~conformance.lockstep.driver.ConformanceFailure` with the vector and
operation named.

A vector the backend's :class:`~spec.capabilities.Capabilities` do not cover (its
geometry, a layer's variant, a large pool without ``read_blocks``) is
skipped, with the reason; see :func:`unsupported`. Attention is split into
the calls the backend accepts, as the lockstep splits it; a sequence whose
query it cannot run at all (a prefill for a decode-only kernel) has its KV
checked and its attention counted as skipped.

In a KV difference the sequence and token named are those whose K and V were
last written to the slot (copies carry them along), as the vector's writes
say; the suite names the live token there, which is the same one unless the
sequence has since been freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import numpy as np
from numpy.typing import NDArray

from conformance.judges.compare import (
    Difference,
    example_difference,
    first_kv_difference,
    first_output_difference,
    latent_output_note,
    latent_part_note,
)
from conformance.judges.coverage import Coverage
from conformance.judges.guard import BackendFault, CallGuard
from conformance.judges.numerics import (
    LARGE_LOGITS,
    USUAL_SCALE,
    ExampleMeter,
    output_errors,
    probability_rounding,
    probability_spread,
    ulp_scale,
)
from conformance.lockstep.calls import attention_calls, sub_batch, token_rows
from conformance.lockstep.driver import ConformanceFailure
from conformance.lockstep.output_check import P_ROUNDING_ALLOWED
from conformance.lockstep.run_stats import RunStats
from conformance.lockstep.workload import kv_parts, large_scale
from conformance.run.profiles import PROFILES
from conformance.run.result import RunResult
from conformance.vectors.consistency import check_operations
from conformance.vectors.format import (
    batch_of,
    check_tolerance,
    geometry_of,
    read_manifest,
    split_kv,
    variant_of,
    vector_dirs,
)
from conformance.vectors.validate import check_values
from spec.attention import AttentionVariant
from spec.attention_batched import paged_attention_batched as spec_attention
from spec.backend import Backend
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_memory import KVMemory

_T = TypeVar("_T")
F64 = NDArray[np.float64]


class _Vector:
    """One vector's manifest, checked whole (:mod:`conformance.vectors.consistency`), read into
    the objects the backend is called with."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.name = directory.name
        m = read_manifest(directory)
        where = str(directory / "manifest.json")
        self.manifest = m
        self.dtype = check_tolerance(where, m.get("tolerance"))
        check_values(m, where)
        self.arrays = check_operations(directory, m)
        self.geometry = geometry_of(m["geometry"])
        self.num_heads: int | None = m["num_heads"]  # None: the example ran no attention
        self.variants = [variant_of(v) for v in m["layer_variants"]]
        self.ops: list[dict[str, Any]] = list(m["operations"])
        self.profile = str(m["source"]["profile"])
        self.seed = int(m["source"]["seed"])
        self.backend_geometry = geometry_of(self.ops[0]["geometry"])


def unsupported(caps: Capabilities, backend: Backend, vector: _Vector) -> str | None:
    """Why ``backend`` cannot run ``vector`` (``None`` when it can): the first reason found."""
    g = vector.geometry
    heads = g.num_kv_heads if vector.num_heads is None else vector.num_heads
    for layer, variant in enumerate(vector.variants):
        why = caps.unsupported(g, heads, variant)
        if why:
            return f"layer {layer}: {', '.join(why)}"
    if caps.tensors != "numpy":
        return f"tensors={caps.tensors!r}: vectors check runs the numpy contract only"
    if not caps.copy_on_write and any(op.get("copies") for op in vector.ops):
        return "copy-on-write copies (capabilities.copy_on_write is False)"
    big = vector.backend_geometry.num_blocks != g.num_blocks
    if big and not callable(getattr(backend, "read_blocks", None)):
        return "a large pool read by blocks (the backend has no read_blocks)"
    return None


@dataclass(frozen=True)
class _Judged:
    """One attention operation's outputs, waiting to be judged after its step's reads."""

    index: int  # of the operation
    step: int
    layer: int
    exact: F64  # the float64 reference, of the rows the backend ran
    same: F64  # the same-precision reference
    actual: F64
    rows: list[tuple[int, int]]  # (sequence, token) of each row
    path: str | None  # the attention paths the backend reported
    query: F64  # the attended rows' queries, their batch, scale and variant: what the spec
    batch: BatchMetadata  # needs to recompute where rounding probabilities can err
    scale: float
    variant: AttentionVariant | None


class _Replay:
    """One vector replayed against one backend; ConformanceFailure at the first difference."""

    def __init__(self, backend: Backend, vector: _Vector, stats: RunStats) -> None:
        self.backend = backend
        self.vector = vector
        self.stats = stats
        self.checks = stats.checks
        self.slowest: tuple[str, float] = ("", 0.0)
        self.guard = CallGuard()
        self.caps = backend.capabilities
        self.step = 0
        self.index = 0
        self.owners: dict[int, tuple[int, int]] = {}
        self.image: dict[tuple[int, int], tuple[F64, F64]] = {}
        self.meter = ExampleMeter(vector.dtype)
        self.pending: list[_Judged] = []  # outputs run, judged after the step's reads
        self.log = [
            "from conformance.vectors.check import replay_vector",
            f"replay_vector(backend, {str(vector.dir.resolve())!r})",
        ]

    def run(self) -> None:
        handlers: dict[str, Callable[[dict[str, Any]], None]] = {
            "create_cache": self._create,
            "write_kv": self._write,
            "copy_blocks": self._copy,
            "attention": self._attention,
            "read_kv": self._read,
            "finish": self._finish,
        }
        for index, op in enumerate(self.vector.ops):
            self.index = index
            self.step = int(op.get("step", self.step))
            kind = str(op["op"])
            if kind in ("copy_blocks", "finish"):  # a new step: judge the last one's outputs
                self._judge()
            handlers[kind](op)
        self._judge()

    # -- operations -------------------------------------------------------------------

    def _create(self, op: dict[str, Any]) -> None:
        self._call("create_cache", self.backend.create_cache, self.vector.backend_geometry)

    def _write(self, op: dict[str, Any]) -> None:
        g = self.vector.backend_geometry
        kv = self.vector.arrays[op["kv"]].astype(np.float32)  # exact: values of the dtype
        key, value = (np.ascontiguousarray(x) for x in split_kv(g, kv))  # latent: c_kv, k_rope
        slots = [int(s) for s in op["slot_mapping"]]
        layer = int(op["layer"])
        self._call("write_kv", self.backend.write_kv, layer, key, value, slots)
        last = (max(slots, default=0) + 1) * g.num_kv_heads * g.head_dim - 1
        self.stats.coverage.note_step(num_seqs=0, decodes=0, max_offset=last)
        for (seq_id, pos), slot in zip(op.get("tokens") or (), slots, strict=False):
            if slot >= 0:
                self.owners[slot] = (int(seq_id), int(pos))

    def _copy(self, op: dict[str, Any]) -> None:
        copies = [(int(s), int(d)) for s, d in op["copies"]]
        self._call("copy_blocks", self.backend.copy_blocks, copies)
        b = self.vector.geometry.block_size
        for src, dst in copies:
            for off in range(b):
                owner = self.owners.get(src * b + off)
                if owner is None:
                    self.owners.pop(dst * b + off, None)
                else:
                    self.owners[dst * b + off] = owner
        if copies:
            self.checks["copy lists executed"] += len(copies)

    def _attention(self, op: dict[str, Any]) -> None:
        """Run the calls the backend accepts (split as the lockstep splits); judge them at once."""
        v = self.vector
        layer = int(op["layer"])
        query = v.arrays[op["query"]].astype(np.float32)  # exact: values of the dtype
        expected = v.arrays[op["expected"]].astype(np.float64)
        batch = batch_of(op["batch"])
        extra = {} if op["variant"] is None else {"variant": variant_of(op["variant"])}
        calls = self._calls(batch)
        g = v.backend_geometry
        actual, paths = [], []
        for call in calls:
            sub = sub_batch(batch, call)
            q = query[token_rows(batch, call)]
            out = self._call(
                "attention", self.backend.attention, layer, q, sub, float(op["scale"]), **extra
            )
            got = np.asarray(out, dtype=np.float64)
            shape = (*q.shape[:2], g.value_dim)  # latent: [T, H, latent_dim], not the query's
            if got.shape != shape:
                self._fail(
                    "shape",
                    f"attention returned shape {got.shape}, expected {shape}"
                    + latent_output_note(g),
                    layer,
                )
            actual.append(got)
            paths.append(self._path())
            decodes = sum(sub.query_len(i) == 1 for i in range(sub.num_seqs))
            self.stats.coverage.note_step(num_seqs=sub.num_seqs, decodes=decodes, max_offset=0)
        attended = [i for call in calls for i in call]
        if not attended:
            return
        rows_of = token_rows(batch, attended)
        exact, same = expected[0][rows_of], expected[1][rows_of]
        got_all = np.concatenate(actual)
        path = "; ".join(dict.fromkeys(p for p in paths if p)) or None
        rows = [
            (batch.seq_ids[i], batch.positions[int(r)])
            for i in attended
            for r in token_rows(batch, [i])
        ]
        self.stats.longest = max(self.stats.longest, batch.max_seq_len)
        self.pending.append(
            _Judged(
                self.index, self.step, layer, exact, same, got_all, rows, path,
                query[rows_of].astype(np.float64), sub_batch(batch, attended),
                float(op["scale"]), extra.get("variant"),
            )
        )  # fmt: skip

    def _judge(self) -> None:
        """Judge the outputs run since the last judgement: after the step's reads (KV first)."""
        pending, self.pending = self.pending, []
        for out in pending:
            dtype, head_dim = self.vector.dtype, self.vector.geometry.head_dim
            scale = ulp_scale(out.exact, dtype)
            regime = LARGE_LOGITS if large_scale(out.scale, head_dim) else USUAL_SCALE
            judge = (out.exact, out.same, out.actual, dtype, regime, out.path, scale)
            errors, spread = output_errors(*judge), None
            if not errors.passed and probability_rounding(dtype) and np.isfinite(out.actual).all():
                spread = self._spread(out)  # where the kernel rounded P, as the lockstep allows
                errors = output_errors(*judge, spread=spread)
                if errors.passed:
                    self.checks[P_ROUNDING_ALLOWED] += 1
            diff = first_output_difference(
                out.step, out.layer, out.exact, out.actual, errors, out.rows, None, spread
            )
            if diff is not None:
                self._raise(diff, out.index)
            self.stats.margins.note_step(errors)
            self.meter.add(out.exact, out.actual, out.same, scale[0])
            self.checks["attention outputs judged against the same-precision reference"] += len(
                out.rows
            )

    def _spread(self, out: _Judged) -> F64:
        """Each output's sigma of probability rounding
        (:func:`~conformance.judges.numerics.probability_spread`), from the KV the vector expects
        the cache to hold now (its reads so far), dequantized."""
        g = self.vector.backend_geometry
        dims = (g.num_layers, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        memory = KVMemory(*dims, lazy=True, latent_dim=g.latent_dim)
        b = g.block_size
        k_scale, v_scale = g.kv_scales[out.layer] if g.kv_dtype is not None else (1.0, 1.0)
        for (layer, block), (k, v) in self.image.items():
            if layer == out.layer:
                slots = list(range(block * b, (block + 1) * b))
                memory.write(layer, k * k_scale, v * v_scale, slots)
        spread: F64 = spec_attention(
            out.query,
            out.batch,
            memory,
            out.layer,
            out.scale,
            variant=out.variant,
            group=g.group_of(out.layer),
            precision=probability_spread(self.vector.dtype),
        )
        return spread

    def _calls(self, batch: BatchMetadata) -> list[list[int]]:
        """The sequences of each call the backend accepts, as the lockstep forms them."""
        return attention_calls(self.caps, batch, self.stats.skips)

    def _read(self, op: dict[str, Any]) -> None:
        v, layer = self.vector, int(op["layer"])
        blocks = op["blocks"]
        g = v.backend_geometry
        ids = list(range(g.num_blocks)) if blocks is None else [int(b) for b in blocks]
        if op["update"] is not None:
            self._update(layer, op["update_slots"], v.arrays[op["update"]])
        got = self._read_backend(layer, blocks, ids)
        for which, (name, width, actual) in enumerate(
            zip(kv_parts(g), g.kv_widths, got, strict=True)
        ):
            row = (g.num_kv_heads, width)
            want = np.stack([self._expected(layer, b)[which] for b in ids])
            diff = first_kv_difference(
                self.step,
                layer,
                name,
                want.reshape(-1, *row),
                actual.reshape(-1, *row),
                self.owners,
                g.block_size,
                slots=(
                    np.asarray(ids, dtype=np.int64)[:, None] * g.block_size
                    + np.arange(g.block_size)
                ).reshape(-1),
            )
            if diff is not None:
                self._raise(diff)
        self.checks["K and V slots compared exactly"] += 2 * len(ids) * g.block_size

    def _finish(self, op: dict[str, Any]) -> None:
        example = self.meter.result()
        self.stats.margins.note_example(example)
        diff = example_difference(self.step, example)
        if diff is not None:
            self._raise(diff)
        self.checks["examples judged for mean error and bias (in ulps)"] += 1

    # -- internals --------------------------------------------------------------------

    def _update(self, layer: int, slots: Sequence[int], update: NDArray[Any]) -> None:
        """The expected contents of ``slots`` from now on: the rows of ``update``, K and V (or
        c_kv and k_rope: :func:`~conformance.vectors.format.split_kv`)."""
        g = self.vector.backend_geometry
        b, parts = g.block_size, split_kv(g, update)
        for j, slot in enumerate(int(s) for s in slots):
            key = (layer, slot // b)
            if key not in self.image:
                k_width, v_width = g.kv_widths
                row = (b, g.num_kv_heads)
                self.image[key] = (np.zeros((*row, k_width)), np.zeros((*row, v_width)))
            for which in (0, 1):
                self.image[key][which][slot % b] = parts[which][j]

    def _expected(self, layer: int, block: int) -> tuple[F64, F64]:
        """The expected contents of a block (every slot of it was updated: checked before)."""
        return self.image[layer, block]

    def _read_backend(self, layer: int, blocks: object, ids: list[int]) -> tuple[F64, F64]:
        g = self.vector.backend_geometry
        read_blocks = getattr(self.backend, "read_blocks", None)
        if blocks is not None and callable(read_blocks):
            got = self._call("read_blocks", read_blocks, layer, ids)
            return self._shaped(got, len(ids), layer)
        got = self._call("read_cache", self.backend.read_cache, layer)
        k, v = self._shaped(got, g.num_blocks, layer)
        return (k, v) if blocks is None else (k[ids], v[ids])

    def _shaped(self, got: object, blocks: int, layer: int) -> tuple[F64, F64]:
        g = self.vector.backend_geometry
        pair = got if isinstance(got, tuple | list) and len(got) == 2 else (got, got)
        out = [np.asarray(x, dtype=np.float64) for x in pair]
        for name, width, x in zip(kv_parts(g), g.kv_widths, out, strict=True):
            shape = (blocks, g.block_size, g.num_kv_heads, width)
            if x.shape != shape:
                detail = (
                    f"read {name} has shape {x.shape}, expected {shape}{latent_part_note(g, name)}"
                )
                self._fail("shape", detail, layer)
        return out[0], out[1]

    def _path(self) -> str | None:
        path = getattr(self.backend, "attention_path", None)
        return None if path is None else str(self._call("attention_path", path))

    def _call(self, what: str, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        start = time.monotonic()
        try:
            return self.guard.call(what, fn, *args, **kwargs)
        except BackendFault as fault:
            self._fail(fault.kind, fault.detail, fault.layer)
        finally:
            took = time.monotonic() - start
            if took > self.slowest[1]:
                self.slowest = (
                    f"backend.{what} at step {self.step} of vector {self.vector.name}",
                    took,
                )

    def _fail(self, what: str, detail: str, layer: int | None) -> NoReturn:
        self._raise(Difference(what, self.step, detail, layer=layer))

    def _raise(self, diff: Difference, index: int | None = None) -> NoReturn:
        at = self.index if index is None else index
        op = self.vector.ops[at].get("op")
        where = f"vector {self.vector.name}, operation {at} ({op}): "
        raise ConformanceFailure(replace(diff, detail=where + diff.detail), self.log)


def replay_vector(backend: Backend, directory: str | Path) -> None:
    """Replay one vector; raises ConformanceFailure at the first difference (a replay script)."""
    _Replay(backend, _Vector(Path(directory)), RunStats()).run()


def check_vectors(
    backend: Backend,
    backend_ref: str,
    root: Path,
    progress: Callable[[str], None] | None = None,
) -> RunResult:
    """Replay every vector under ``root``; the result reads like a ``run``'s (its reports too).

    Raises :class:`~conformance.vectors.format.VectorError` (a setup error) for
    a missing or corrupt vector, before or while replaying it.
    """
    start = time.monotonic()
    vectors = [_Vector(d) for d in vector_dirs(root)]
    caps = backend.capabilities
    first = vectors[0]
    stats = RunStats()
    profile = first.profile if first.profile in PROFILES else "quick"
    result = RunResult(
        backend=backend_ref,
        profile=profile,
        seed=first.seed,
        capabilities=caps,
        skipped=(),
        stats=stats,
        notes=(f"{len(vectors)} vectors in {root}",),
        envelope="vectors",
        requested=(len(vectors), 0),
        reproduce=f"python -m conformance vectors check {root} --backend {backend_ref}",
    )
    for vector in vectors:
        why = unsupported(caps, backend, vector)
        if why:
            result.skipped += (f"vector {vector.name}: {why}",)
            continue
        stats.examples += 1
        stats.configs[_shape(vector)] += 1
        _note_coverage(stats.coverage, vector)
        replay = _Replay(backend, vector, stats)
        try:
            replay.run()
        except ConformanceFailure as failure:
            stats.note_failure()
            result.difference, result.workload = failure.difference, failure.log
            result.shrink_note = "vectors are replayed as exported, not shrunk"
            break
        finally:
            _count_ops(stats, vector.ops)
            result.slowest_call = max(result.slowest_call, replay.slowest, key=lambda c: c[1])
        if progress is not None:
            progress(f"vector {vector.name}: passed")
    result.passes = [("vectors", len(vectors))]
    result.wall_time_s = time.monotonic() - start
    return result


def _count_ops(stats: RunStats, ops: Sequence[Mapping[str, Any]]) -> None:
    for op in ops:
        stats.rules[f"vector operations: {op.get('op')}"] += 1
    stats.steps += max((int(op.get("step", 0)) for op in ops), default=0)


def _note_coverage(coverage: Coverage, vector: _Vector) -> None:
    g = vector.geometry
    if vector.num_heads is None:  # no attention ran: no GQA ratio to note
        return
    coverage.note_shape(
        head_dim=g.head_dim,
        block_size=g.block_size,
        num_kv_heads=g.num_kv_heads,
        gqa_ratio=vector.num_heads // g.num_kv_heads,
        dtype=g.dtype,
        latent=g.kv_widths if g.is_latent else None,
    )


def _shape(vector: _Vector) -> str:
    g = vector.geometry
    kv = "" if g.kv_dtype is None else f" KV {g.kv_dtype}"
    heads = "-" if vector.num_heads is None else vector.num_heads
    width = f"latent {g.latent_dim}+{g.rope_dim}" if g.is_latent else f"D={g.head_dim}"
    return f"{g.dtype} B={g.block_size} H={heads}/{g.num_kv_heads} {width}{kv}"
