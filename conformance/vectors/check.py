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
)
from conformance.judges.coverage import Coverage
from conformance.judges.guard import BackendFault, CallGuard
from conformance.judges.numerics import ExampleMeter, output_errors, ulp_scale
from conformance.lockstep.driver import ConformanceFailure
from conformance.lockstep.machine import RunStats
from conformance.run.calls import attention_calls, sub_batch, token_rows
from conformance.run.runner import PROFILES, RunResult
from conformance.vectors.format import (
    VectorError,
    check_tolerance,
    load_array,
    read_manifest,
    vector_dirs,
)
from conformance.vectors.safe import confined
from conformance.vectors.validate import check_values
from spec.attention import AttentionVariant
from spec.backend import Backend
from spec.batch import BatchMetadata, GroupLayout
from spec.capabilities import Capabilities
from spec.errors import SpecError
from spec.kv_geometry import KVGeometry

_T = TypeVar("_T")
F64 = NDArray[np.float64]


class _Vector:
    """One vector's manifest, read into the objects the backend is called with."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.name = directory.name
        m = read_manifest(directory)
        where = str(directory / "manifest.json")
        self.manifest = m
        self.dtype = check_tolerance(where, m.get("tolerance"))
        check_values(m, where)
        try:
            self.geometry = _geometry(m["geometry"])
            heads = m["num_heads"]  # None: the example ran no attention
            self.num_heads: int | None = None if heads is None else int(heads)
            self.regime = str(m["scale_regime"])
            self.variants = [_variant(v) for v in m["layer_variants"]]
            self.ops: list[dict[str, Any]] = list(m["operations"])
            self.profile = str(m["source"]["profile"])
            self.seed = int(m["source"]["seed"])
        except (KeyError, TypeError, ValueError, SpecError) as err:
            raise VectorError(f"{where}: missing or malformed field: {err!r}") from err
        if not self.ops or self.ops[0].get("op") != "create_cache":
            raise VectorError(f"{where}: operations must start with create_cache")
        self.backend_geometry = _geometry(self.ops[0]["geometry"])

    def array(self, name: object, where: str) -> NDArray[Any]:
        """An array the manifest names: inside the vector directory, every value finite."""
        out = load_array(confined(self.dir, name, f"{self.dir}: {where}"))
        if not np.isfinite(out).all():
            raise VectorError(f"{self.dir}: {where}: {name} holds a NaN or infinite value")
        return out


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
        self.written: dict[int, set[int]] = {}  # per layer: the slots the vector's writes filled
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
            kind = op.get("op")
            if kind not in handlers:
                raise VectorError(
                    f"{self.vector.dir}: operations[{self.index}]: unknown op {kind!r}"
                )
            try:
                if kind in ("copy_blocks", "finish"):  # a new step: judge the last one's outputs
                    self._judge()
                handlers[str(kind)](op)
            except (KeyError, TypeError, ValueError, IndexError, SpecError) as err:
                raise VectorError(
                    f"{self.vector.dir}: operations[{self.index}] ({kind}): malformed: {err!r}"
                ) from err
        self._judge()

    # -- operations -------------------------------------------------------------------

    def _create(self, op: dict[str, Any]) -> None:
        self._call("create_cache", self.backend.create_cache, self.vector.backend_geometry)

    def _write(self, op: dict[str, Any]) -> None:
        kv = self.vector.array(op["kv"], "kv")
        slots = [int(s) for s in op["slot_mapping"]]
        layer = int(op["layer"])
        g = self.vector.backend_geometry
        row, top = (g.num_kv_heads, g.head_dim), g.num_blocks * g.block_size
        if not 0 <= layer < g.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{g.num_layers - 1}")
        if kv.ndim != 4 or kv.shape[0] != 2 or kv.shape[2:] != row or kv.shape[1] < len(slots):
            raise ValueError(f"kv has shape {kv.shape}, expected (2, >= {len(slots)}, *{row})")
        bad = [s for s in slots if not -1 <= s < top]
        if bad:
            raise ValueError(f"slot {bad[0]} is outside -1..{top - 1}")
        self._call("write_kv", self.backend.write_kv, layer, kv[0], kv[1], slots)
        self.written.setdefault(layer, set()).update(s for s in slots if s >= 0)
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
        for filled in self.written.values():
            for src, dst in copies:
                for off in range(b):
                    if src * b + off in filled:
                        filled.add(dst * b + off)
                    else:
                        filled.discard(dst * b + off)
        if copies:
            self.checks["copy lists executed"] += len(copies)

    def _attention(self, op: dict[str, Any]) -> None:
        """Run the calls the backend accepts (split as the lockstep splits); judge them at once."""
        v = self.vector
        layer = int(op["layer"])
        query = v.array(op["query"], "query").astype(np.float32)
        expected = v.array(op["expected"], "expected").astype(np.float64)
        batch = _batch(op["batch"])
        batch.validate(
            v.backend_geometry.num_blocks
        )  # a malformed vector is not the backend's fault
        heads = (v.num_heads, v.geometry.head_dim)
        if (
            expected.shape != (2, *query.shape)
            or query.shape[0] != batch.num_tokens
            or query.shape[1:] != heads
        ):
            raise VectorError(
                f"{v.dir}: operations[{self.index}]: query {query.shape} and expected "
                f"{expected.shape} do not fit a batch of {batch.num_tokens} tokens"
            )
        variant = _variant(op["variant"])
        extra = {} if variant is None else {"variant": variant}
        calls = self._calls(batch)
        actual, paths = [], []
        for call in calls:
            sub = sub_batch(batch, call)
            q = query[token_rows(batch, call)]
            out = self._call(
                "attention", self.backend.attention, layer, q, sub, float(op["scale"]), **extra
            )
            got = np.asarray(out, dtype=np.float64)
            if got.shape != q.shape:
                self._fail(
                    "shape", f"attention returned shape {got.shape}, expected {q.shape}", layer
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
        self.pending.append(_Judged(self.index, self.step, layer, exact, same, got_all, rows, path))

    def _judge(self) -> None:
        """Judge the outputs run since the last judgement: after the step's reads (KV first)."""
        pending, self.pending = self.pending, []
        for out in pending:
            scale = ulp_scale(out.exact, self.vector.dtype)
            errors = output_errors(
                out.exact,
                out.same,
                out.actual,
                self.vector.dtype,
                self.vector.regime,
                out.path,
                scale,
            )
            diff = first_output_difference(
                out.step, out.layer, out.exact, out.actual, errors, out.rows
            )
            if diff is not None:
                self._raise(diff, out.index)
            self.stats.margins.note_step(errors)
            self.meter.add(out.exact, out.actual, out.same, scale[0])
            self.checks["attention outputs judged against the same-precision reference"] += len(
                out.rows
            )

    def _calls(self, batch: BatchMetadata) -> list[list[int]]:
        """The sequences of each call the backend accepts, as the lockstep forms them."""
        return attention_calls(self.caps, batch, self.stats.skips)

    def _read(self, op: dict[str, Any]) -> None:
        v, layer = self.vector, int(op["layer"])
        blocks = op["blocks"]
        g = v.backend_geometry
        ids = list(range(g.num_blocks)) if blocks is None else [int(b) for b in blocks]
        if op.get("update") is not None:
            self._update(layer, op["update_slots"], v.array(op["update"], "update"))
        k, v_ = self._read_backend(layer, blocks, ids)
        row = (g.num_kv_heads, g.head_dim)
        for which, (name, actual) in enumerate((("K", k), ("V", v_))):
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
        """The expected contents of ``slots`` from now on: rows ``update[0]`` (K), ``[1]`` (V)."""
        g = self.vector.backend_geometry
        b, row = g.block_size, (g.num_kv_heads, g.head_dim)
        if update.shape != (2, len(slots), *row):
            raise VectorError(
                f"{self.vector.dir}: operations[{self.index}]: update has shape {update.shape}, "
                f"expected {(2, len(slots), *row)}"
            )
        unwritten = [s for s in slots if s not in self.written.get(layer, ())]
        if unwritten:  # the image would blame the backend for what the vector never wrote
            raise VectorError(
                f"{self.vector.dir}: operations[{self.index}].update_slots: slot {unwritten[0]} "
                f"of layer {layer} was never written by the vector's write_kv operations"
            )
        for j, slot in enumerate(int(s) for s in slots):
            key = (layer, slot // b)
            if key not in self.image:
                self.image[key] = (np.zeros((b, *row)), np.zeros((b, *row)))
            self.image[key][0][slot % b] = update[0, j]
            self.image[key][1][slot % b] = update[1, j]

    def _expected(self, layer: int, block: int) -> tuple[F64, F64]:
        try:
            return self.image[layer, block]
        except KeyError:
            raise VectorError(
                f"{self.vector.dir}: operations[{self.index}]: block {block} of layer {layer} is "
                "read before any update gave its expected contents"
            ) from None

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
        shape = (blocks, g.block_size, g.num_kv_heads, g.head_dim)
        pair = got if isinstance(got, tuple | list) and len(got) == 2 else (got, got)
        out = [np.asarray(x, dtype=np.float64) for x in pair]
        for name, x in zip("KV", out, strict=True):
            if x.shape != shape:
                self._fail("shape", f"read {name} has shape {x.shape}, expected {shape}", layer)
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
    )


def _shape(vector: _Vector) -> str:
    g = vector.geometry
    kv = "" if g.kv_dtype is None else f" KV {g.kv_dtype}"
    heads = "-" if vector.num_heads is None else vector.num_heads
    return f"{g.dtype} B={g.block_size} H={heads}/{g.num_kv_heads} D={g.head_dim}{kv}"


def _geometry(d: Mapping[str, Any]) -> KVGeometry:
    return KVGeometry(
        num_layers=int(d["num_layers"]),
        num_blocks=int(d["num_blocks"]),
        block_size=int(d["block_size"]),
        num_kv_heads=int(d["num_kv_heads"]),
        head_dim=int(d["head_dim"]),
        dtype=str(d["dtype"]),
        kv_dtype=None if d["kv_dtype"] is None else str(d["kv_dtype"]),
        kv_scales=tuple((float(k), float(v)) for k, v in d["kv_scales"]),
        layer_groups=tuple(int(x) for x in d["layer_groups"]),
    )


def _variant(d: Mapping[str, Any] | None) -> AttentionVariant | None:
    if d is None:
        return None
    sinks, slopes = d.get("sinks"), d.get("alibi_slopes")
    return AttentionVariant(
        window=d.get("window"),
        softcap=d.get("softcap"),
        sinks=None if sinks is None else tuple(float(x) for x in sinks),
        alibi_slopes=None if slopes is None else tuple(float(x) for x in slopes),
    )


def _batch(d: Mapping[str, Any]) -> BatchMetadata:
    """The batch of an attention operation (the :meth:`BatchMetadata.arrays` layout)."""
    seq_lens = tuple(int(x) for x in d["seq_lens"])
    num_seqs = len(seq_lens)
    tables = [tuple(tuple(int(b) for b in row) for row in t[:num_seqs]) for t in d["group_tables"]]
    slots = [tuple(int(s) for s in group) for group in d["group_slots"]]
    return BatchMetadata(
        block_size=int(d["block_size"]),
        seq_ids=tuple(int(x) for x in d["seq_ids"]),
        query_start_loc=tuple(int(x) for x in d["query_start_loc"]),
        seq_lens=seq_lens,
        block_tables=tables[0],
        slot_mapping=slots[0],
        positions=tuple(int(x) for x in d["positions"]),
        copies=tuple((int(s), int(t)) for s, t in d["copies"]),
        extra_groups=tuple(GroupLayout(t, s) for t, s in zip(tables[1:], slots[1:], strict=True)),
    )
