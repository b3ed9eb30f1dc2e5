"""The spec and a backend side by side: the same operations, compared after every step.

A :class:`Lockstep` owns a spec :class:`~spec.block_manager.BlockManager` and
:class:`~spec.kv_memory.KVMemory` and the backend under test. The spec decides
block tables, slot mappings and copy lists; both sides execute them. After
every step, every slot of the backend's cache must equal the spec's bit for bit
(reported per live sequence and logical token first), and every attention
output must match the float64 reference within the dtype's tolerance.

Each operation is also logged as a line of Python, so that a failing workload
replays as a plain script (see :mod:`conformance.report`):

>>> from spec.backend import KVGeometry, ReferenceBackend
>>> config = WorkloadConfig(KVGeometry(1, 4, 2, 1, 8), num_heads=2, scale=0.35, seed=1)
>>> ls = Lockstep(ReferenceBackend(), config)
>>> ls.add(0, [7, 8, 9])
0
>>> ls.step([(0, [7, 8, 9])])
[0]
>>> ls.log[-2:]
['ls.add(0, [7, 8, 9])', 'ls.step([(0, [7, 8, 9])])']
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NoReturn, TypeVar

import numpy as np
from numpy.typing import NDArray

from conformance.compare import Difference, first_kv_difference, first_output_difference
from conformance.dtypes import F64, TOLERANCES
from conformance.guard import BackendFault, CallGuard
from conformance.variants import describe, describe_kv
from conformance.workload import TokenKV, WorkloadConfig, background, padding_rows, queries
from spec.attention import paged_attention
from spec.backend import Backend
from spec.batch import BatchMetadata, build_batch
from spec.block_manager import PAD_SLOT, BlockManager
from spec.errors import OutOfBlocksError
from spec.kv_memory import KVMemory
from spec.quant import dequantize, quantize

_T = TypeVar("_T")


class ConformanceFailure(AssertionError):
    """The backend disagreed with the spec; carries the difference and the workload so far."""

    def __init__(self, difference: Difference, log: Sequence[str]) -> None:
        super().__init__(difference.describe())
        self.difference = difference
        self.log = list(log)


class Lockstep:
    """Drives ``backend`` and the spec through the same workload; raises on the first difference."""

    def __init__(
        self,
        backend: Backend,
        config: WorkloadConfig,
        checks: Counter[str] | None = None,
        guard: CallGuard | None = None,
    ) -> None:
        g = config.geometry
        self.backend = backend
        self.guard = CallGuard() if guard is None else guard
        self.config = config
        self.manager = BlockManager(
            g.num_blocks, g.block_size, enable_prefix_caching=config.prefix_caching
        )
        self.memory = KVMemory(
            g.num_layers,
            g.num_blocks,
            g.block_size,
            g.num_kv_heads,
            g.head_dim,
            kv_dtype=g.kv_dtype,
            kv_scales=g.kv_scales,
        )
        self.truth = TokenKV(config)
        self.checks: Counter[str] = Counter() if checks is None else checks
        self.step_index = 0
        self.log = [f"ls = Lockstep(backend, {config!r})"]
        self.guard.attach(self)  # the guard reports the workload with each call
        self._call("create_cache", backend.create_cache, g)
        self._prime()

    # -- operations ---------------------------------------------------------------

    def add(self, seq_id: int, prompt: Sequence[int]) -> int:
        """Start a sequence; return how many prompt tokens the prefix cache supplied."""
        self.log.append(f"ls.add({seq_id}, {list(prompt)!r})")
        return self.manager.add_sequence(seq_id, prompt)

    def fork(self, parent_id: int, child_id: int) -> None:
        self.log.append(f"ls.fork({parent_id}, {child_id})")
        self.manager.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        self.log.append(f"ls.free({seq_id})")
        self.manager.free(seq_id)

    def step(self, schedule: Sequence[tuple[int, Sequence[int]]]) -> list[int]:
        """Append each sequence's new tokens and run one step; return the sequences that ran.

        A sequence the pool cannot grow is left out of the step, unchanged.
        """
        self.log.append(f"ls.step({[(s, list(t)) for s, t in schedule]!r})")
        ran = [(seq_id, len(tokens)) for seq_id, tokens in schedule if self._append(seq_id, tokens)]
        if not ran:
            return []
        self.step_index += 1
        batch = build_batch(self.manager, ran)
        self._call("copy_blocks", self.backend.copy_blocks, list(batch.copies))
        self.memory.copy_blocks(batch.copies)
        outputs = [
            self._run_layer(layer, batch) for layer in range(self.config.geometry.num_layers)
        ]
        self.check_cache()  # KV first: a wrong cache is the usual root cause of a wrong output
        self._check_outputs(batch, outputs)
        return [seq_id for seq_id, _ in ran]

    # -- checks -------------------------------------------------------------------

    def check_cache(self) -> None:
        """Every slot of the backend's cache equals the spec's, and the spec equals the truth."""
        g = self.config.geometry
        owners = self._owners()
        shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
        for layer in range(g.num_layers):
            got = self._call("read_cache", self.backend.read_cache, layer)
            for name, actual, expected in zip(
                "KV", got, (self.memory.k[layer], self.memory.v[layer]), strict=True
            ):
                actual = _f64(actual)
                if actual.shape != shape:
                    self._fail(
                        "shape",
                        f"read_cache({layer}) {name} has shape {actual.shape}, expected {shape}",
                        layer=layer,
                    )
                flat = (g.num_blocks * g.block_size, g.num_kv_heads, g.head_dim)
                diff = first_kv_difference(
                    self.step_index,
                    layer,
                    name,
                    expected.reshape(flat),
                    actual.reshape(flat),
                    owners,
                    g.block_size,
                )
                if diff is not None:
                    raise ConformanceFailure(self._named(diff, layer), self.log)
            self.checks["K and V of every slot compared exactly"] += 2 * flat[0]
            self.checks["K and V of live tokens compared exactly"] += 2 * len(owners)
        self._check_spec_truth()

    def _check_spec_truth(self) -> None:
        """The spec's memory holds each live token's true K and V (a check of the spec itself)."""
        for seq_id in self.manager.sequence_ids():
            tokens = self.manager.tokens(seq_id)
            table = self.manager.block_table(seq_id)
            for layer in range(self.config.geometry.num_layers):
                k, v = self.memory.gather(layer, table, len(tokens))
                tk, tv = (
                    self._as_read(x, layer, i) for i, x in enumerate(self.truth.rows(tokens, layer))
                )
                if not (np.array_equal(k, tk) and np.array_equal(v, tv)):
                    raise AssertionError(
                        f"internal error: the spec's KV for sequence {seq_id}, layer {layer} is "
                        "not what was written for its tokens (a bug in spec/, not the backend)"
                    )
            self.checks["spec KV equals the tokens' ground truth"] += len(tokens)

    def _as_read(self, x: F64, layer: int, which: int) -> F64:
        """What attention reads back for written values ``x``: themselves, or fp8 round trips."""
        g = self.config.geometry
        if g.kv_dtype is None:
            return x
        scale = g.kv_scales[layer][which]
        return dequantize(quantize(x, scale, g.kv_dtype), scale)

    def _check_outputs(self, batch: BatchMetadata, outputs: Sequence[tuple[F64, F64]]) -> None:
        rows = [
            (seq_id, pos)
            for i, seq_id in enumerate(batch.seq_ids)
            for pos in range(batch.seq_lens[i] - batch.query_len(i), batch.seq_lens[i])
        ]
        tolerance = TOLERANCES[self.config.dtype]
        for layer, (expected, actual) in enumerate(outputs):
            diff = first_output_difference(
                self.step_index, layer, expected, actual, tolerance, rows
            )
            if diff is not None:
                raise ConformanceFailure(self._named(diff, layer), self.log)
            self.checks["attention outputs compared to the float64 reference"] += len(rows)

    # -- internals ----------------------------------------------------------------

    def _prime(self) -> None:
        """Fill every slot with known values first, so that any stray write is visible."""
        g = self.config.geometry
        slots = list(range(g.num_blocks * g.block_size))
        for layer in range(g.num_layers):
            k, v = background(self.config, layer)
            self._call("write_kv", self.backend.write_kv, layer, _f32(k), _f32(v), slots)
            self.memory.write(layer, k, v, slots)
        self.check_cache()

    def _append(self, seq_id: int, tokens: Sequence[int]) -> bool:
        m = self.manager
        before = (m.block_table(seq_id), m.num_tokens(seq_id), m.pool.num_available)
        try:
            m.append_slots(seq_id, tokens)
        except OutOfBlocksError:
            after = (m.block_table(seq_id), m.num_tokens(seq_id), m.pool.num_available)
            assert before == after, f"internal error: a failed allocation changed {seq_id}"
            self.checks["failed allocations left the state unchanged"] += 1
            return False
        return True

    def _run_layer(self, layer: int, batch: BatchMetadata) -> tuple[F64, F64]:
        """Write this step's K and V (with padding) and run attention on both sides."""
        c = self.config
        key, value = self._new_kv(layer, batch)
        pad = self.step_index % 3  # padding slots (-1), then one row past the slot mapping
        junk = padding_rows(c, self.step_index, layer, pad + 1)
        slots = list(batch.slot_mapping) + [PAD_SLOT] * pad
        self._call(
            "write_kv",
            self.backend.write_kv,
            layer,
            _f32(np.concatenate([key, junk])),
            _f32(np.concatenate([value, -junk])),
            slots,
        )
        self.memory.write(layer, key, value, batch.slot_mapping)
        query = queries(c, self.step_index, layer, batch.num_tokens)
        variant = c.variant(layer)
        extra = {} if variant.is_plain else {"variant": variant}  # plain calls stay unchanged
        attend = self.backend.attention
        actual = self._call("attention", attend, layer, _f32(query), batch, c.scale, **extra)
        actual = _f64(actual)
        if actual.shape != query.shape:
            self._fail(
                "shape",
                f"attention returned shape {actual.shape}, expected {query.shape}",
                layer=layer,
            )
        group = c.geometry.group_of(layer)
        expected = paged_attention(
            query, batch, self.memory, layer, c.scale, variant=variant, group=group
        )
        return expected, actual

    def _new_kv(self, layer: int, batch: BatchMetadata) -> tuple[F64, F64]:
        keys, values = [], []
        for i, seq_id in enumerate(batch.seq_ids):
            k, v = self.truth.rows(self.manager.tokens(seq_id), layer)
            new = slice(batch.seq_lens[i] - batch.query_len(i), batch.seq_lens[i])
            keys.append(k[new])
            values.append(v[new])
        return np.concatenate(keys), np.concatenate(values)

    def _owners(self) -> dict[int, tuple[int, int]]:
        """Slot -> (sequence, token) for every live token (the lowest sequence id if shared)."""
        owners: dict[int, tuple[int, int]] = {}
        b = self.manager.block_size
        for seq_id in sorted(self.manager.sequence_ids()):
            table = self.manager.block_table(seq_id)
            for pos in range(self.manager.num_tokens(seq_id)):
                owners.setdefault(table[pos // b] * b + pos % b, (seq_id, pos))
        return owners

    def _call(self, what: str, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        """One backend call, through the guard (:mod:`conformance.guard`)."""
        try:
            return self.guard.call(what, fn, *args, **kwargs)
        except BackendFault as fault:
            self._fail(fault.kind, fault.detail, layer=fault.layer)

    def _named(self, diff: Difference, layer: int) -> Difference:
        """``diff`` with the layer's attention variant and KV dtype (and fp8 scales) named."""
        c = self.config
        kind = f"{describe(c.variant(layer))}; {describe_kv(c.geometry, layer)}"
        return replace(diff, detail=f"{diff.detail} [layer {layer}: {kind}]")

    def _fail(self, what: str, detail: str, layer: int | None = None) -> NoReturn:
        raise ConformanceFailure(Difference(what, self.step_index, detail, layer=layer), self.log)


def _f64(x: object) -> F64:
    out: F64 = np.asarray(x, dtype=np.float64)
    return out


def _f32(x: F64) -> NDArray[np.float32]:
    return x.astype(np.float32)
