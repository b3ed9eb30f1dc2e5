"""Exporting the suite's workloads as test vectors: the reference backend, recorded.

The export runs the lockstep suite itself (:func:`conformance.run.runner.run_suite`)
against :class:`_Recorder`, the spec's reference backend with a recorder
around every call. So the vectors hold exactly the calls the live suite makes
(``run --backend reference --seed N`` draws the same workloads), and exactly
the values it compares against:

* each ``attention`` call: the float64 reference output (the reference
  backend's own) and the same-precision reference output, rounded to the
  dtype (:func:`conformance.judges.numerics.same_precision`), with the tolerance
  rule to apply (:func:`conformance.vectors.format.tolerance`);
* each read of the cache (``read_cache`` or ``read_blocks``): the blocks read
  and the expected contents of those that changed since the previous read of
  the layer (every other block read must be unchanged), so a vector stores
  each value once however often the suite compares it.

A new example starts at each ``create_cache``; a step at each
``copy_blocks`` (the lockstep calls it once per step, first). Every geometry
the reference backend runs is recorded, the latent layout too (format version
2: its writes and reads hold rows, :func:`conformance.vectors.format.kv_shape`).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from conformance.errors import SetupError
from conformance.judges.dtypes import round_to
from conformance.judges.numerics import LARGE_LOGITS, USUAL_SCALE, same_precision
from conformance.lockstep.workload import large_scale
from conformance.output_files import check_output_folder
from conformance.run.control import RunControl
from conformance.run.profiles import PROFILES
from conformance.run.runner import run_suite
from conformance.vectors.format import (
    ARRAYS,
    FORMAT,
    VERSION,
    join_kv,
    save_array,
    tolerance,
    write_manifest,
)
from spec.attention import AttentionVariant
from spec.attention_batched import paged_attention_batched
from spec.backend import FloatArray, ReferenceBackend
from spec.batch import BatchMetadata
from spec.kv_geometry import KVGeometry
from spec.quant import quantize, quantize_range


@dataclass
class ExportSummary:
    """What an export wrote: examples, files and bytes, and the run it recorded."""

    out: Path
    profile: str
    seed: int
    examples: int = 0
    files: int = 0
    bytes: int = 0
    operations: int = 0
    passes: list[tuple[str, int]] = field(default_factory=list)

    def describe(self) -> str:
        passes = ", ".join(f"{name} {n}" for name, n in self.passes)
        return (
            f"exported {self.examples} vectors ({self.operations} operations, {self.files} "
            f"files, {self.bytes / 1e6:.1f} MB) to {self.out}\n"
            f"  profile {self.profile}, seed {self.seed}; passes (examples asked): {passes}\n"
            f"  check a backend: python -m conformance vectors check {self.out} --backend NAME"
        )


class _Example:
    """One example being recorded: its operations and arrays, and the expected cache image."""

    def __init__(self, directory: Path, geometry: KVGeometry) -> None:
        self.dir = directory
        self.geometry = geometry
        self.ops: list[dict[str, Any]] = [{"op": "create_cache", "geometry": _geometry(geometry)}]
        self.step = 0
        self.arrays = 0
        self.num_heads: int | None = None
        self.scale: float | None = None
        self.variants: dict[int, dict[str, Any] | None] = {}
        self.image: dict[tuple[int, int], tuple[FloatArray, FloatArray]] = {}
        self.pending_write: dict[int, dict[str, Any]] = {}  # layer -> this step's write op

    def array(self, x: NDArray[Any]) -> str:
        """Save ``x`` under ``arrays/``; its path relative to the example directory."""
        name = f"{ARRAYS}/{self.arrays:06d}.npy"
        self.arrays += 1
        save_array(self.dir / name, _compact(x))
        return name


def unambiguous(x: FloatArray, scale: float, kv_dtype: str, dtype: str) -> FloatArray:
    """``x`` with every value whose fp8 quotient lies within a compiled division's error of a
    rounding boundary (two correct stored values: :func:`spec.quant.quantize_range`) moved,
    in the activation dtype, toward the side the spec stores until only that side is correct.

    The stored values, and so every expected output of the vector, are unchanged; and every
    reader and backend must then store the same bytes, so a vector's KV is compared exactly.
    The live suite draws such ties on purpose; a vector keeps them out of its data.

    >>> x = np.array([1.8125 * 0.875, 1.0], dtype=np.float32)      # a tie, and a plain value
    >>> unambiguous(x, 0.875, "fp8_e4m3", "float32").tolist()
    [1.5859298706054688, 1.0]
    >>> quantize(_, 0.875, "fp8_e4m3").tolist()                     # still the tie's even side
    [1.75, 1.125]
    """
    out = np.array(x, dtype=np.float32)
    nominal = quantize(out, scale, kv_dtype)
    for _ in range(64):
        low, high = quantize_range(out, scale, kv_dtype)
        loose = low != high
        if not loose.any():
            return out
        toward = np.where(nominal > out / np.float32(scale), 1.0, -1.0)
        moved = out + toward * _step(out, dtype)  # exact in the dtype: one of its ulps or more
        out = np.where(loose, round_to(moved, dtype), out).astype(np.float32)
    raise AssertionError("internal error: a tie could not be moved off its boundary")


def _step(x: NDArray[np.float32], dtype: str) -> NDArray[np.float64]:
    """A move of ``x`` by one ulp of ``dtype`` (at least 64 float32 ulps: clear of 2 ulp)."""
    ulp32 = np.spacing(np.abs(x)).astype(np.float64)
    if dtype == "float16":
        ulp = np.spacing(np.abs(x).astype(np.float16)).astype(np.float64)
    elif dtype == "bfloat16":
        ulp = ulp32 * 2.0**16
    else:
        ulp = ulp32
    out: NDArray[np.float64] = np.maximum(ulp, 64 * ulp32)
    return out


class _Recorder(ReferenceBackend):
    """The reference backend, recording every call the lockstep makes into an example."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.examples: list[_Example] = []

    @property
    def current(self) -> _Example:
        assert self.examples, "create_cache is the lockstep's first call"
        return self.examples[-1]

    def create_cache(self, geometry: KVGeometry) -> None:
        super().create_cache(geometry)
        if self.examples:
            self._finish(self.current)
        self.examples.append(_Example(self.out / f"{len(self.examples):04d}", geometry))

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        super().write_kv(layer, key, value, slot_mapping)
        ex = self.current
        g = ex.geometry
        if g.kv_dtype is not None:  # the same bytes stored, and no tie left to either side
            key, value = (
                unambiguous(x, g.kv_scales[layer][which], g.kv_dtype, g.dtype)
                for which, x in enumerate((key, value))
            )
        op = {
            "op": "write_kv",
            "step": ex.step,
            "layer": layer,
            "slot_mapping": [int(s) for s in slot_mapping],
            "kv": ex.array(join_kv(g, key, value)),  # latent: the rows, c_kv then k_rope
            "tokens": None,
        }
        ex.ops.append(op)
        ex.pending_write[layer] = op

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        super().copy_blocks(copies)
        ex = self.current
        ex.step += 1
        ex.pending_write.clear()
        ex.ops.append(
            {"op": "copy_blocks", "step": ex.step, "copies": [[int(s), int(d)] for s, d in copies]}
        )

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        exact = super().attention(layer, query, batch, scale, variant=variant)
        ex, g = self.current, self._geo()
        if batch.state is not None:
            raise SetupError("vectors do not carry state layouts (state_cache) yet")
        group = g.group_of(layer)
        precision = same_precision(g.dtype, g.kv_dtype is not None)
        q64 = np.asarray(query, dtype=np.float64)
        same = paged_attention_batched(
            q64, batch, self._mem(), layer, scale, variant=variant, group=group, precision=precision
        )
        write = ex.pending_write.get(layer)
        if write is not None and write["tokens"] is None:
            write["tokens"] = _tokens(batch)
        ex.num_heads, ex.scale = int(query.shape[1]), float(scale)
        ex.variants[layer] = None if variant is None else _variant(variant)
        ex.ops.append(
            {
                "op": "attention",
                "step": ex.step,
                "layer": layer,
                "scale": float(scale),
                "variant": None if variant is None else _variant(variant),
                "batch": _batch(batch),
                "query": ex.array(np.asarray(query, dtype=np.float32)),
                "expected": ex.array(np.stack([exact, round_to(same, g.dtype)])),
            }
        )
        return exact

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        k, v = super().read_cache(layer)
        self._read(layer, None, k, v)
        return k, v

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[FloatArray, FloatArray]:
        k, v = super().read_blocks(layer, blocks)
        self._read(layer, [int(b) for b in blocks], k, v)
        return k, v

    def _read(self, layer: int, blocks: list[int] | None, k: FloatArray, v: FloatArray) -> None:
        """Record a read: the blocks, and the new expected contents of the slots that changed."""
        ex, b = self.current, self._geo().block_size
        ids = list(range(k.shape[0])) if blocks is None else blocks
        slots, rows_k, rows_v = [], [], []
        for j, blk in enumerate(ids):
            known = ex.image.get((layer, blk))
            if known is None:
                changed = np.arange(b)
            else:
                same = _rows_equal(known[0], k[j]) & _rows_equal(known[1], v[j])
                changed = np.flatnonzero(~same)
            if changed.size:
                ex.image[layer, blk] = (k[j].copy(), v[j].copy())
                slots += [blk * b + int(r) for r in changed]
                rows_k.append(k[j][changed])
                rows_v.append(v[j][changed])
        op: dict[str, Any] = {"op": "read_kv", "step": ex.step, "layer": layer, "blocks": blocks}
        op["update_slots"] = slots
        parts = (np.concatenate(rows_k), np.concatenate(rows_v)) if slots else None
        op["update"] = None if parts is None else ex.array(join_kv(ex.geometry, *parts))
        ex.ops.append(op)

    def finish(self, profile: str, seed: int, passes: list[tuple[str, int]]) -> None:
        if self.examples:
            self._finish(self.current)
        for ex in self.examples:
            ex.ops.append({"op": "finish", "step": ex.step})
        self._manifests(profile, seed, passes)

    def _finish(self, ex: _Example) -> None:
        ex.pending_write.clear()
        ex.image.clear()

    def _manifests(self, profile: str, seed: int, passes: list[tuple[str, int]]) -> None:
        for i, ex in enumerate(self.examples):
            g = ex.geometry
            large = ex.scale is not None and large_scale(ex.scale, g.head_dim)
            write_manifest(
                ex.dir,
                {
                    "format": FORMAT,
                    "version": VERSION,
                    "example": i,
                    "source": {
                        "profile": profile,
                        "seed": seed,
                        "passes": [[name, n] for name, n in passes],
                        "suite": f"python -m conformance run --backend reference "
                        f"--profile {profile} --seed {seed}",
                    },
                    "geometry": _geometry(g),
                    "num_heads": ex.num_heads,  # None: the example ran no attention
                    "scale": ex.scale,
                    "scale_regime": LARGE_LOGITS if large else USUAL_SCALE,
                    "layer_variants": [ex.variants.get(n) for n in range(g.num_layers)],
                    "tolerance": tolerance(g.dtype),
                    "operations": ex.ops,
                },
            )


def export_vectors(
    out: Path,
    *,
    profile: str = "quick",
    seed: int | None = None,
    examples: int | None = None,
) -> ExportSummary:
    """Run the suite on the recorded reference backend and write one vector per example.

    ``out`` must not exist yet or be empty (:class:`SetupError` otherwise);
    ``examples`` overrides the profile's example count, as ``run --max-examples``.
    """
    if profile not in PROFILES:
        raise SetupError(f"--profile {profile!r}: choose one of {', '.join(sorted(PROFILES))}")
    if examples is not None and examples < 1:
        raise SetupError(f"--examples must be at least 1, got {examples}")
    out = check_output_folder(out, "--out")  # a link resolved once; a device or FIFO refused
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SetupError(f"--out {out}: exists and is not an empty directory; choose a new one")
    run_seed = random.randrange(2**32) if seed is None else seed
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    recorder = _Recorder(out)
    try:
        result = run_suite(
            recorder,
            "reference",
            profile=profile,
            run_seed=run_seed,
            database=None,
            max_examples=examples,
            shrink=False,
            control=RunControl(poison="off"),  # the format holds finite data only
        )
        if not result.passed:
            detail = "" if result.difference is None else result.difference.describe()
            raise SetupError(f"the reference backend failed its own suite: {detail}")
        recorder.finish(profile, run_seed, result.passes)
    except BaseException:  # no half-written export is left behind, only what was there
        for path in [out] if created else list(out.iterdir()):
            shutil.rmtree(path, ignore_errors=True)
        raise
    files = [p for p in out.rglob("*") if p.is_file()]
    return ExportSummary(
        out=out,
        profile=profile,
        seed=run_seed,
        examples=len(recorder.examples),
        files=len(files),
        bytes=sum(p.stat().st_size for p in files),
        operations=sum(len(ex.ops) for ex in recorder.examples),
        passes=list(result.passes),
    )


def _geometry(g: KVGeometry) -> dict[str, Any]:
    d = asdict(g)
    d["kv_scales"] = [list(pair) for pair in g.kv_scales]
    d["layer_groups"] = list(g.layer_groups)
    return d


def _variant(v: AttentionVariant) -> dict[str, Any]:
    d = asdict(v)
    for name in ("sinks", "alibi_slopes"):
        if d[name] is not None:
            d[name] = list(d[name])
    return d


def _batch(batch: BatchMetadata) -> dict[str, Any]:
    """The batch in the layout of :meth:`BatchMetadata.arrays`, plus the sequence ids."""
    a = batch.arrays()
    return {
        "block_size": batch.block_size,
        "seq_ids": list(batch.seq_ids),
        "query_start_loc": a.query_start_loc.tolist(),
        "seq_lens": a.seq_lens.tolist(),
        "positions": a.positions.tolist(),
        "copies": a.copies.tolist(),
        "group_tables": [t.tolist() for t in a.group_tables],
        "group_slots": [s.tolist() for s in a.group_slots],
    }


def _tokens(batch: BatchMetadata) -> list[list[int]]:
    """``[sequence, position]`` of each new token, in batch row order."""
    out = []
    for i, seq_id in enumerate(batch.seq_ids):
        for r in range(batch.query_start_loc[i], batch.query_start_loc[i + 1]):
            out.append([seq_id, batch.positions[r]])
    return out


def _rows_equal(a: FloatArray, b: FloatArray) -> NDArray[np.bool_]:
    """Which rows (slots) of two blocks ``[B, H_kv, D]`` hold the same values (NaN equal to NaN)."""
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    out: NDArray[np.bool_] = same.reshape(same.shape[0], -1).all(axis=1)
    return out


def _compact(x: NDArray[Any]) -> NDArray[Any]:
    """``x`` as float32 when that loses nothing, else float64."""
    x64 = np.asarray(x, dtype=np.float64)
    x32 = x64.astype(np.float32)
    with np.errstate(invalid="ignore"):
        lossless = np.array_equal(x32.astype(np.float64), x64, equal_nan=True)
    return x32 if lossless else x64
