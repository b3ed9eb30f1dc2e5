"""The spec and a backend side by side: the same operations, compared after every step.

A :class:`Lockstep` owns a spec :class:`~spec.block_manager.BlockManager` and
:class:`~spec.kv_memory.KVMemory` and the backend under test. The spec decides
block tables, slot mappings and copy lists; both sides execute them. After
every step the backend's cache must equal the spec's bit for bit (reported per
live sequence and logical token first), and every attention output must be as
close to the float64 reference as a kernel of its precision gets
(:mod:`conformance.judges.numerics`).

What the backend sees can differ from what the spec decides in two ways:

* **A large pool** (``config.block_base > 0``): the spec's pool stays small,
  and spec block ``b`` is backend block ``block_base + b`` in everything the
  backend is handed (tables, slots, copies, reads), so KV element offsets
  pass 2^31 while the spec, the comparison and the backend's resident memory
  stay small. One guard block below and one above are primed and must never
  change.
* **Capabilities**: a backend is never handed an attention batch its
  :class:`~spec.capabilities.Capabilities` refuse. Attention is split into calls
  it accepts (decodes apart from prefill chunks without ``mixed_batches``, at
  most ``max_num_seqs`` sequences each); a sequence whose query it cannot run
  at all (a prefill for a decode-only kernel) still has its KV written and
  compared, and its attention is counted as skipped, with the reason.

Pools of up to :data:`WHOLE_POOL_SLOTS` slots are compared whole after every
step. Larger ones are compared where the step wrote (the blocks written or
copied into, and their neighbours), and whole every :data:`SWEEP_EVERY` steps
and at :meth:`Lockstep.finish`, so a stray write anywhere is still caught.
A backend under the device-resident contract (``tensors="torch"``) is handed
the same operations as tensors on its device (:mod:`conformance.judges.device_contract`)
and compared as a larger pool is, so that only what is compared crosses back.

**Speculation** (:mod:`spec.speculative`): ``step(schedule, drafts={seq: k})``
runs a row whose last ``k`` tokens are drafts in lookahead slots, then
:meth:`Lockstep.verify` keeps ``a`` of them or :meth:`Lockstep.rollback` none.
Both sides keep the rejected K/V past the sequence's length, so the cache
still compares bit for bit, and every later output shows whether a kernel
read any of it. After each of these operations the memory side is checked
against the speculative rules themselves (kind ``"memory"``): every token,
draft or not, has a slot in a block of its table, and no block holding a
draft or only partly verified carries a prefix-cache hash. A planted memory
bug (:mod:`conformance.planted.speculative`) swaps the spec's block manager for
its own through the backend's ``planted_block_manager`` attribute, which no
real backend has.

With a :class:`~conformance.bounds.checker.BoundsChecker` (``bounds=``), every backend
call that may launch kernels (:data:`BOUNDS_CHECKED`) runs inside its
``watch``, and a call in which a kernel accessed memory outside what
:data:`spec.batch.PADDING_RULE` allows fails as kind ``"bounds"``, before
anything the call returned is compared: a refused access makes the outputs
meaningless.

Each operation is also logged as a line of Python, so that a failing workload
replays as a plain script (see :mod:`conformance.reports.report`):

>>> from spec.backend import KVGeometry, ReferenceBackend
>>> config = WorkloadConfig(KVGeometry(1, 4, 2, 1, 8), num_heads=2, scale=0.35, seed=1)
>>> ls = Lockstep(ReferenceBackend(), config)
>>> ls.add(0, [7, 8, 9])
0
>>> ls.step([(0, [7, 8, 9])])
[0]
>>> ls.finish()
>>> ls.log[-3:]
['ls.add(0, [7, 8, 9])', 'ls.step([(0, [7, 8, 9])])', 'ls.finish()']
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import NoReturn, TypeVar

import numpy as np
from numpy.typing import NDArray

from conformance.bounds.checker import BoundsChecker, Watched
from conformance.errors import SetupError, SpecSideBug, SuiteStopped
from conformance.judges.compare import (
    Difference,
    example_difference,
    first_kv_difference,
    first_output_difference,
    latent_output_note,
    latent_part_note,
)
from conformance.judges.coverage import Coverage
from conformance.judges.device_contract import (
    ContractMismatch,
    DeviceContract,
    setup_problem,
    uses_device_contract,
)
from conformance.judges.dtypes import F64, round_to
from conformance.judges.guard import BackendFault, CallGuard
from conformance.judges.hypotheses import case_for, diagnose
from conformance.judges.numerics import (
    LARGE_LOGITS,
    USUAL_SCALE,
    ExampleMeter,
    Margins,
    output_errors,
    probability_rounding,
    probability_spread,
    ulp_scale,
)
from conformance.judges.oracle import (
    ORACLE_NAMES,
    SPEC,
    OracleChoice,
    oracle_for_run,
    reference_outputs,
    step_cost,
)
from conformance.judges.resident_kv import ResidentKV
from conformance.lockstep.group_memory import GroupMemory, describe_groups, released_rows
from conformance.lockstep.pairs import call_features, call_path, path_run
from conformance.lockstep.tables import widen
from conformance.lockstep.variants import describe, describe_kv
from conformance.lockstep.workload import (
    NON_FINITE,
    POISONS,
    SequenceTruth,
    TokenKV,
    WorkloadConfig,
    background,
    guard_background,
    kv_parts,
    large_logits,
    padding_rows,
    poison_rows,
    queries,
)
from conformance.observe.launches import Launch, recording
from conformance.observe.paths import observe
from conformance.run.calls import attention_calls, sub_batch, token_rows
from spec.attention import AttentionVariant
from spec.attention_batched import paged_attention_batched as spec_attention
from spec.backend import Backend
from spec.batch import PAD_BLOCK, BatchMetadata, GroupLayout, build_batch
from spec.block_manager import PAD_SLOT, BlockManager, cdiv
from spec.block_pool import BlockPool
from spec.capabilities import Capabilities
from spec.errors import OutOfBlocksError
from spec.kv_geometry import KVGeometry
from spec.kv_memory import KVMemory, held_lazily
from spec.quant import dequantize, quantize, quantize_range

_T = TypeVar("_T")

WHOLE_POOL_SLOTS = 4096
"""Pools of at most this many slots are compared whole after every step."""
SWEEP_EVERY = 8
"""Larger pools are compared whole every this many steps (and at the end)."""
READ_ELEMENTS = 1 << 24
"""Elements of K (and as many of V) read back at once in a comparison: a larger pool is read
and compared by blocks, in parts of at most this many (128 MiB each as float64)."""
ACCEPTED_NEIGHBOURS = (
    "fp8 values accepted as the other side of a rounding tie (a compiled division: 2 ulp)"
)
"""The check that counts stored fp8 values the spec took from a backend: each the other neighbour
a correct kernel may store where the exact quotient lies within 2 ulp of a rounding boundary."""
P_ROUNDING_ALLOWED = (
    "steps and layers passed allowing for where the kernel rounds probabilities (6 sigma)"
)
"""The check that counts outputs judged less :data:`~conformance.judges.numerics.PROBABILITY_SIGMAS`
of probability rounding: they failed check 1 against the reference's own rounding alone."""
BOUNDS_CHECKED = (
    "create_cache",
    "write_kv",
    "copy_blocks",
    "attention",
    "read_cache",
    "read_blocks",
)
"""The backend calls that may launch kernels: those a bounds checker watches (all but the
capabilities and ``attention_path``, which only describe the backend)."""


class ConformanceFailure(AssertionError):
    """The backend disagreed with the spec; carries the difference and the workload so far (and
    its configuration, from which a run names the failure's cause)."""

    def __init__(
        self, difference: Difference, log: Sequence[str], config: WorkloadConfig | None = None
    ) -> None:
        super().__init__(difference.describe())
        self.difference = difference
        self.log = list(log)
        self.config = config


class Lockstep:
    """Drives ``backend`` and the spec through the same workload; raises on the first difference."""

    def __init__(
        self,
        backend: Backend,
        config: WorkloadConfig,
        checks: Counter[str] | None = None,
        guard: CallGuard | None = None,
        *,
        skips: Counter[str] | None = None,
        coverage: Coverage | None = None,
        margins: Margins | None = None,
        whole_pool_slots: int = WHOLE_POOL_SLOTS,
        bounds: BoundsChecker | None = None,
        oracle: OracleChoice | None = None,
        call_seconds: dict[str, float] | None = None,
    ) -> None:
        g = config.geometry
        self.call_seconds: dict[str, float] = {} if call_seconds is None else call_seconds
        self.backend = backend
        self.bounds = bounds
        self.guard = CallGuard() if guard is None else guard
        self.config = config
        self.base = config.block_base
        self.groups = GroupMemory(config) if config.group_windows else None
        self._released = 0  # table entries released by windows, as last noted in the coverage
        manager_cls = getattr(backend, "planted_block_manager", BlockManager)
        self.manager = (
            manager_cls(g.num_blocks, g.block_size, enable_prefix_caching=config.prefix_caching)
            if self.groups is None
            else self.groups.manager  # group 0's: read it, the groups' memory drives it
        )
        self.truth = TokenKV(config)
        self.checks: Counter[str] = Counter() if checks is None else checks
        self.skips: Counter[str] = Counter() if skips is None else skips
        self.coverage = Coverage() if coverage is None else coverage
        self.margins = Margins() if margins is None else margins  # the run's, at finish()
        self._margins = Margins()  # this example's, until it has passed
        self.step_index = 0
        checked = "" if bounds is None else f", bounds={bounds!r}"  # replays check the same
        self.log = [f"ls = Lockstep(backend, {config!r}{checked})"]
        self._truth = SequenceTruth(self.truth)
        self._whole = g.num_blocks * g.block_size <= whole_pool_slots
        self._example = ExampleMeter(g.dtype)
        self._regime = LARGE_LOGITS if large_logits(config) else USUAL_SCALE
        self._clean = True
        self._oracle_used = SPEC
        self.caps: Capabilities = self._call("capabilities", lambda: backend.capabilities)
        self._read_blocks = getattr(backend, "read_blocks", None)
        if self.base and self._read_blocks is None:
            raise ValueError("a large pool needs the backend's read_blocks(layer, blocks)")
        self._device = self._device_contract()
        self.oracle = oracle or oracle_for_run(self.caps.device)
        self.memory = _memory(g, self.oracle)
        ratio = config.num_heads // g.num_kv_heads
        self.coverage.note_shape(
            head_dim=g.head_dim,
            block_size=g.block_size,
            num_kv_heads=g.num_kv_heads,
            gqa_ratio=ratio,
            dtype=g.dtype,
            latent=g.kv_widths if g.is_latent else None,
        )
        self._guards = self._guard_blocks()
        if self.groups is not None:
            self.coverage.note_group_example(describe_groups(config))
        self.guard.attach(self)  # the guard reports the workload with each call
        with self._op():
            self._call("create_cache", backend.create_cache, self.backend_geometry)
            self._prime()

    @property
    def backend_geometry(self) -> KVGeometry:
        """The geometry the backend allocates: the spec's, or a large pool around it."""
        g = self.config.geometry
        return replace(g, num_blocks=self.base + g.num_blocks + 1) if self.base else g

    # -- operations ---------------------------------------------------------------

    def add(self, seq_id: int, prompt: Sequence[int]) -> int:
        """Start a sequence; return how many prompt tokens the prefix cache supplied."""
        self.log.append(f"ls.add({seq_id}, {list(prompt)!r})")
        with self._op():
            if self.groups is not None:
                return self.groups.add(seq_id, prompt)
            return self.manager.add_sequence(seq_id, prompt)

    def fork(self, parent_id: int, child_id: int) -> None:
        self.log.append(f"ls.fork({parent_id}, {child_id})")
        with self._op():
            if self.groups is not None:
                self.groups.fork(parent_id, child_id)
            else:
                self.manager.fork(parent_id, child_id)
            self._truth.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        self.log.append(f"ls.free({seq_id})")
        with self._op():
            if self.groups is not None:
                self.groups.free(seq_id)
            else:
                self.manager.free(seq_id)
            self._truth.drop(seq_id)

    def step(
        self,
        schedule: Sequence[tuple[int, Sequence[int]]],
        drafts: Mapping[int, int] | None = None,
    ) -> list[int]:
        """Append each sequence's new tokens and run one step; return the sequences that ran.

        A sequence the pool cannot grow is left out of the step, unchanged.
        ``drafts`` names the speculative rows: the last ``drafts[seq]`` tokens
        of ``seq``'s are drafts, in lookahead slots until :meth:`verify` or
        :meth:`rollback`.
        """
        k = dict(drafts or {})
        extra = f", drafts={k!r}" if k else ""
        self.log.append(f"ls.step({[(s, list(t)) for s, t in schedule]!r}{extra})")
        with self._op():
            ran = [
                (s, len(tokens)) for s, tokens in schedule if self._append(s, tokens, k.get(s, 0))
            ]
            if not ran:
                return []
            self.step_index += 1
            batch = self._layout(ran)
            self.poison_unowned()
            self._call("copy_blocks", self.backend.copy_blocks, self._shift_copies(batch.copies))
            self.memory.copy_blocks(batch.copies)
            calls = self._attention_calls(batch)
            layers = range(self.config.geometry.num_layers)
            ran_layers = [self._run_layer(layer, batch, calls) for layer in layers]
            # KV first: a wrong cache is the usual root cause of a wrong output. And the
            # references after it, from the KV that is there (an accepted fp8 neighbour).
            whole = self._whole or self.step_index % SWEEP_EVERY == 0
            self._check_kv(None if whole else _written_blocks(batch), batch.seq_ids)
            outputs = [
                (*self._reference(query, batch_done, layer), got, paths)
                for layer, (query, batch_done, got, paths) in zip(layers, ran_layers, strict=True)
            ]
            self._check_outputs(batch, calls, outputs)
            return [seq_id for seq_id, _ in ran]

    def verify(self, seq_id: int, num_accepted: int) -> None:
        """Keep ``num_accepted`` of ``seq_id``'s drafts (its step ran); reject the rest."""
        self.log.append(f"ls.verify({seq_id}, {num_accepted})")
        with self._op():
            if self.groups is not None:
                self.groups.cache.verify(seq_id, num_accepted)
            else:
                self.manager.verify(seq_id, num_accepted)
            self._check_speculation(seq_id)

    def rollback(self, seq_id: int) -> None:
        """Reject every draft of ``seq_id``: it returns to its verified tokens."""
        self.log.append(f"ls.rollback({seq_id})")
        with self._op():
            if self.groups is not None:
                self.groups.cache.rollback(seq_id)
            else:
                self.manager.rollback(seq_id)
            self._check_speculation(seq_id)

    def finish(self) -> None:
        """The end of a workload: the whole pool compared; the outputs' mean error and bias judged.

        Does nothing after an operation that did not complete (a failure, or
        an error inside the suite): its state is not one to judge.
        """
        self.log.append("ls.finish()")
        if not self._clean:
            return
        with self._op():
            self._check_kv(None, None)
            example = self._example.result()
            self._margins.note_example(example)
            diff = example_difference(self.step_index, example)
            if diff is not None:
                raise ConformanceFailure(diff, self.log, self.config)
            self.checks["examples judged for mean error and bias (in ulps)"] += 1
            self.margins.add(self._margins)  # a passing example's: its failures are reported

    # -- checks -------------------------------------------------------------------

    def check_integrity(self) -> None:
        """The spec's block-table and pool invariants (every group's, with KV cache groups);
        a break stops the run as the spec's or the suite's bug (:class:`SpecSideBug`)."""
        try:
            if self.groups is not None:
                self.groups.check_integrity()
            else:
                self.manager.check_integrity()
        except AssertionError as err:
            raise SuiteStopped(
                SpecSideBug(f"after step {self.step_index}, the spec's block tables or pool: {err}")
            ) from err

    def check_cache(self) -> None:
        """Every block of the spec's pool (and the guards) equals the backend's, bit for bit."""
        with self._op():
            self._check_kv(None, None)

    def _check_kv(self, blocks: list[int] | None, seq_ids: Sequence[int] | None) -> None:
        """Compare ``blocks`` (all if ``None``) and the guards; then the spec against the truth."""
        g = self.config.geometry
        ids = (
            list(range(g.num_blocks)) if blocks is None else [x for x in blocks if x < g.num_blocks]
        )
        owners = [self._owners(group) for group in range(g.num_groups)]
        b, names = g.block_size, kv_parts(g)
        slots = (np.asarray(ids, dtype=np.int64)[:, None] * b + np.arange(b)).reshape(-1)
        chunk = self._read_chunk(len(ids))
        for layer in range(g.num_layers):
            found: dict[str, list[Difference]] = {name: [] for name in names}
            for lo in range(0, len(ids), chunk):
                part = ids[lo : lo + chunk]
                got = self._read(layer, part)
                want = self._accepted(layer, part, got)  # a lazy pool (2^26 elements) too
                for name, width, spec, actual in zip(names, g.kv_widths, want, got, strict=True):
                    row = (g.num_kv_heads, width)
                    diff = first_kv_difference(
                        self.step_index,
                        layer,
                        name,
                        spec.reshape(-1, *row),
                        actual.reshape(-1, *row),
                        owners[g.group_of(layer)],
                        b,
                        slots=slots[lo * b : (lo + len(part)) * b],
                        block_offset=self.base,
                    )
                    if diff is not None:
                        found[name].append(diff)
            for diffs in found.values():
                if diffs:  # a live token's first (as one read would), else the first slot
                    live = [d for d in diffs if d.seq_id is not None]
                    first = (
                        min(live, key=lambda d: (d.seq_id or 0, d.token or 0)) if live else diffs[0]
                    )
                    raise ConformanceFailure(self._named(first, layer), self.log, self.config)
            self._check_guards(layer)
        self.checks["K and V slots compared exactly"] += 2 * g.num_layers * len(ids) * b
        if blocks is None:
            self.checks["whole-pool comparisons"] += 1
        self._check_spec_truth(None if blocks is None else seq_ids, blocks)

    def _accepted(self, layer: int, blocks: list[int], got: tuple[F64, F64]) -> tuple[F64, F64]:
        """The spec's K and V of ``blocks``, once it holds each fp8 value the backend stored that
        is the other one a correct kernel may store there (a compiled division lands on either
        side of a rounding tie: :func:`spec.quant.quantize_range`). Attention is judged from
        then on against the KV that is there; anything else stays a difference."""
        want = self.memory.read_blocks(layer, blocks)
        if self.config.geometry.kv_dtype is None:
            return want
        b = self.config.geometry.block_size
        changed = 0
        for which, other in enumerate(self.memory.others(layer, blocks)):
            held, actual = want[which], got[which]
            takes = _same(actual, other) & ~_same(actual, held)
            rows = np.flatnonzero(takes.reshape(len(blocks) * b, -1).any(axis=1))
            if rows.size == 0:
                continue
            slots = [blocks[r // b] * b + r % b for r in rows.tolist()]
            merged = np.where(takes, actual, held).reshape(len(blocks) * b, *held.shape[2:])
            changed += self.memory.accept(layer, which, slots, merged[rows])
        if not changed:
            return want
        self.checks[ACCEPTED_NEIGHBOURS] += changed
        return self.memory.read_blocks(layer, blocks)

    def _read_chunk(self, num_blocks: int) -> int:
        """Blocks per read of a comparison: all of them, unless they pass
        :data:`READ_ELEMENTS` and the backend reads by blocks (a device-scale pool read
        whole would be gigabytes, twice: the backend's copy and the spec's)."""
        g = self.config.geometry
        per_block = g.block_size * g.num_kv_heads * g.head_dim
        if num_blocks * per_block <= READ_ELEMENTS or self._read_blocks is None:
            return max(num_blocks, 1)
        return max(1, READ_ELEMENTS // per_block)

    def _check_guards(self, layer: int) -> None:
        """The guard blocks around a large pool's workload still hold their primed values."""
        if not self._guards:
            return
        g = self.config.geometry
        ids = [blk for blk, _ in self._guards]
        got = self._read(layer, ids, backend_ids=True)
        want = guard_background(self.config, layer, len(ids) * g.block_size)
        for which, name in enumerate(kv_parts(g)):
            row = (g.num_kv_heads, g.kv_widths[which])
            expected = self._as_stored(want[which], layer, which)
            if self.config.geometry.kv_dtype is not None:  # either side of a tie is correct
                low, high = self._stored_range(want[which], layer, which)
                actual = got[which].reshape(expected.shape)
                expected = np.where(_same(actual, low) | _same(actual, high), actual, expected)
            for j, (blk, _) in enumerate(self._guards):
                lo = j * g.block_size
                diff = first_kv_difference(
                    self.step_index,
                    layer,
                    name,
                    expected[lo : lo + g.block_size].reshape(-1, *row),
                    got[which][j].reshape(-1, *row),
                    {},
                    g.block_size,
                    slots=list(range(blk * g.block_size, (blk + 1) * g.block_size)),
                )
                if diff is not None:
                    detail = f"guard block {blk} (the workload never writes it) changed: "
                    raise ConformanceFailure(
                        replace(diff, detail=detail + diff.detail), self.log, self.config
                    )
        self.checks["guard blocks around a large pool unchanged"] += len(ids)

    def _check_spec_truth(
        self, seq_ids: Sequence[int] | None, blocks: Sequence[int] | None = None
    ) -> None:
        """The spec's memory holds each live token's true K and V (a check of the spec itself).

        After a step, only what it could have changed: each of its sequences from
        its first block among ``blocks`` on (re-reading every context at every
        step cost more than the backend's attention at 64 x 2,048); every live
        token at a whole-pool comparison.
        """
        live = self.manager.sequence_ids() if seq_ids is None else seq_ids
        touched = None if blocks is None else frozenset(blocks)
        b = self.config.geometry.block_size
        for seq_id in live:
            tokens = self.manager.tokens(seq_id)
            n, checked = len(tokens), 0
            for layer in range(self.config.geometry.num_layers):
                table, start = self._held(seq_id, layer)
                lo = start if touched is None else _first_touched(table, touched, start, n, b)
                if lo == n:
                    continue
                held = self.memory.gather(layer, table, n, start=lo)
                truth = self._truth.rows(seq_id, tokens, layer)
                if not all(
                    self._reads_as(x, t[lo:], layer, i)
                    for i, (x, t) in enumerate(zip(held, truth, strict=True))
                ):
                    raise SuiteStopped(
                        SpecSideBug(
                            f"at step {self.step_index}, the spec's KV for sequence {seq_id}, "
                            f"layer {layer} is not what was written for its tokens"
                        )
                    )
                checked = max(checked, n - lo)
            self.checks["spec KV equals the tokens' ground truth"] += checked

    def _reads_as(self, held: F64, written: F64, layer: int, which: int) -> bool:
        """Whether the spec's memory reads back ``held`` for written values ``written``: they
        themselves, or for fp8, a value a correct kernel may store for each, dequantized."""
        g = self.config.geometry
        if g.kv_dtype is None:
            return bool(np.array_equal(held, written))
        scale = g.kv_scales[layer][which]
        low, high = (dequantize(x, scale) for x in self._stored_range(written, layer, which))
        return bool((_same(held, low) | _same(held, high)).all())

    def _stored_range(self, x: F64, layer: int, which: int) -> tuple[F64, F64]:
        """The lowest and highest fp8 value a correct cache stores for ``x``."""
        g = self.config.geometry
        assert g.kv_dtype is not None
        return quantize_range(x, g.kv_scales[layer][which], g.kv_dtype)

    def _as_stored(self, x: F64, layer: int, which: int) -> F64:
        """What the cache stores for written values ``x``: themselves, or their fp8 values."""
        g = self.config.geometry
        if g.kv_dtype is None:
            return x
        return quantize(x, g.kv_scales[layer][which], g.kv_dtype)

    def _check_outputs(
        self,
        batch: BatchMetadata,
        calls: list[_Call],
        outputs: Sequence[tuple[F64, F64, F64, list[str]]],
    ) -> None:
        attended = [i for call in calls for i in call]
        rows = [
            (batch.seq_ids[i], pos)
            for i in attended
            for pos in range(batch.seq_lens[i] - batch.query_len(i), batch.seq_lens[i])
        ]
        dtype = self.config.dtype
        for layer, (exact, same, actual, paths) in enumerate(outputs):
            if not rows:
                continue
            path = "; ".join(dict.fromkeys(p for p in paths if p)) or None
            same = round_to(same, dtype)
            scale = ulp_scale(exact, dtype)
            oracle = None if self._oracle_used == SPEC else self._oracle_name()
            judge = (exact, same, actual, dtype, self._regime, path, scale, oracle)
            errors, spread = output_errors(*judge, products=self.caps.products), None
            if not errors.passed and probability_rounding(dtype) and np.isfinite(actual).all():
                spread = self._spread(batch, attended, layer)  # where the kernel rounded P
                errors = output_errors(*judge, spread=spread, products=self.caps.products)
                if errors.passed:
                    self.checks[P_ROUNDING_ALLOWED] += 1
            self._margins.note_step(errors)
            diff = first_output_difference(
                self.step_index, layer, exact, actual, errors, rows, self._poison_name, spread
            )
            if diff is not None:
                diff = replace(
                    diff, diagnosis=self._diagnose(batch, attended, layer, exact, actual)
                )
                raise ConformanceFailure(self._named(diff, layer), self.log, self.config)
            self._example.add(exact, actual, same, scale[0])
            self.checks["attention outputs judged against the same-precision reference"] += len(
                rows
            )
            self.checks[f"attention outputs judged by {self._oracle_name()}"] += len(rows)

    def _spread(self, batch: BatchMetadata, attended: list[int], layer: int) -> F64:
        """Each attended output's sigma of probability rounding (:func:`probability_spread`),
        computed by the spec from the KV the step read."""
        c = self.config
        query = queries(c, self.step_index, layer, batch.num_tokens)[token_rows(batch, attended)]
        spread: F64 = spec_attention(
            query,
            sub_batch(batch, attended),
            self.memory,
            layer,
            c.scale,
            variant=c.variant(layer),
            group=c.geometry.group_of(layer),
            precision=probability_spread(c.dtype),
        )
        return spread

    def _diagnose(
        self, batch: BatchMetadata, attended: list[int], layer: int, exact: F64, actual: F64
    ) -> str | None:
        """The named mistake (:mod:`conformance.judges.hypotheses`) that reproduces ``actual``."""
        c = self.config
        query = queries(c, self.step_index, layer, batch.num_tokens)[token_rows(batch, attended)]
        case = case_for(
            query,
            sub_batch(batch, attended),
            self.memory,
            layer,
            c.geometry.group_of(layer),
            c.scale,
            c.variant(layer),
            c.dtype,
        )
        return diagnose(case, exact, actual)

    @property
    def _poison_name(self) -> str | None:
        """What slots no live token owns hold in this example, when it is not finite."""
        return self.config.poison if self.config.poison in NON_FINITE else None

    def poison_unowned(self, everywhere: bool = False) -> None:
        """Fill every slot no live token owns with the example's poison, on both sides.

        Free blocks, the tails of partial blocks, blocks a window released and
        evicted blocks handed to a new owner; not a free block the prefix cache
        still holds (a later prompt may hit it). Written through ``write_kv``, as
        any KV is, only where a slot does not hold poison already (``everywhere``:
        in every slot, as priming does). Nothing when the example is not poisoned.
        """
        c = self.config
        if c.poison is None:
            return
        g = c.geometry
        b = g.block_size
        for group in range(g.num_groups):
            owned = self._owners(group)
            pool = self._pool(group)
            layers = [x for x in range(g.num_layers) if g.group_of(x) == group]
            k, _ = self.memory.read_blocks(layers[0], list(range(g.num_blocks)))
            flat = k.reshape(g.num_blocks * b, -1)
            value = POISONS[c.poison]
            held = np.isnan(flat) if np.isnan(value) else np.equal(flat, value)
            poisoned = np.zeros(flat.shape[0], dtype=np.bool_)
            if not everywhere:
                poisoned |= np.asarray(held, dtype=np.bool_).reshape(flat.shape).all(axis=1)
            slots = [
                s
                for s in range(g.num_blocks * b)
                if s not in owned
                and not poisoned[s]
                and not (pool.ref_count(s // b) == 0 and pool.block_hash(s // b) is not None)
            ]
            if not slots:
                continue
            k_rows, v_rows = poison_rows(c, len(slots))
            for layer in layers:
                self._write_kv(layer, k_rows, v_rows, self._shift_slots(slots))
                self.memory.write(layer, k_rows, v_rows, slots)
            self.checks["slots no live token owns poisoned"] += len(slots) * len(layers)

    def _pool(self, group: int) -> BlockPool:
        manager = self.manager if self.groups is None else self.groups.managers[group]
        return manager.pool

    # -- internals ----------------------------------------------------------------

    @contextmanager
    def _op(self) -> Iterator[None]:
        """One operation: if anything escapes it, :meth:`finish` no longer judges the state."""
        self._clean = False
        yield
        self._clean = True

    def _guard_blocks(self) -> list[tuple[int, int]]:
        """``(backend block, spec-side index)`` of the guard blocks of a large pool."""
        if not self.base:
            return []
        return [(self.base - 1, 0), (self.base + self.config.geometry.num_blocks, 1)]

    def _prime(self) -> None:
        """Fill every slot with known values first, so that any stray write is visible (poison,
        in a poisoned example)."""
        if self.config.poison is not None:
            self._prime_guards()
            self.poison_unowned(everywhere=True)
            self._check_kv(None, None)
            return
        g = self.config.geometry
        b = g.block_size
        slots = list(range(g.num_blocks * b))
        guard_slots = [s for blk, _ in self._guards for s in range(blk * b, (blk + 1) * b)]
        for layer in range(g.num_layers):
            k, v = background(self.config, layer)
            gk, gv = guard_background(self.config, layer, len(guard_slots))
            self._write_kv(
                layer,
                np.concatenate([k, gk]),
                np.concatenate([v, gv]),
                self._shift_slots(slots) + guard_slots,
            )
            self.memory.write(layer, k, v, slots)
        self._note_offset(max(self._shift_slots(slots) + guard_slots))
        self._check_kv(None, None)

    def _prime_guards(self) -> None:
        """A poisoned example's guard blocks: primed with their known values all the same."""
        g = self.config.geometry
        b = g.block_size
        guard_slots = [s for blk, _ in self._guards for s in range(blk * b, (blk + 1) * b)]
        if not guard_slots:
            return
        for layer in range(g.num_layers):
            gk, gv = guard_background(self.config, layer, len(guard_slots))
            self._write_kv(layer, gk, gv, guard_slots)
        self._note_offset(max(guard_slots))

    def _append(self, seq_id: int, tokens: Sequence[int], num_draft: int = 0) -> bool:
        if self.groups is not None:
            ran = self.groups.append(seq_id, tokens, num_draft)
            if not ran:
                self.checks["failed allocations left every KV cache group unchanged"] += 1
        else:
            m = self.manager
            before = (m.block_table(seq_id), m.num_tokens(seq_id), m.pool.num_available)
            try:
                m.append_slots(seq_id, tokens, num_draft=num_draft)
                ran = True
            except OutOfBlocksError:
                after = (m.block_table(seq_id), m.num_tokens(seq_id), m.pool.num_available)
                assert before == after, f"internal error: a failed allocation changed {seq_id}"
                self.checks["failed allocations left the state unchanged"] += 1
                ran = False
        if ran and num_draft:
            self._check_speculation(seq_id)
        return ran

    def _managers(self) -> tuple[BlockManager, ...]:
        return (self.manager,) if self.groups is None else self.groups.managers

    def _check_speculation(self, seq_id: int) -> None:
        """The memory rules of :mod:`spec.speculative` for ``seq_id``, in every group.

        Every token, drafts included, has a slot in a block of its table (the
        lookahead counted every block the ``1 + k`` tokens touch), and no block
        from the first not wholly verified one on carries a prefix-cache hash
        (a hit on it could serve a rejected token's K/V, or one overwritten since).
        """
        for group, m in enumerate(self._managers()):
            b, table, n = m.block_size, m.block_table(seq_id), m.num_tokens(seq_id)
            verified = n - m.num_drafts(seq_id)
            if len(table) < cdiv(n, b):
                self._fail(
                    "memory",
                    f"sequence {seq_id} (group {group}) holds {len(table)} blocks for {n} tokens "
                    f"({m.num_drafts(seq_id)} of them drafts): the lookahead slots past a block "
                    f"boundary have no block (it needs {cdiv(n, b)})",
                )
            for i in range(verified // b, len(table)):
                if table[i] != PAD_BLOCK and m.pool.block_hash(table[i]) is not None:
                    self._fail(
                        "memory",
                        f"sequence {seq_id} (group {group}): block {table[i]} (table entry {i}) "
                        f"has a prefix-cache hash but holds tokens past the {verified} verified "
                        "ones (drafts, or rejected and overwritten)",
                    )
        self.checks["speculative memory rules checked (lookahead blocks, unhashed drafts)"] += 1

    def _attention_calls(self, batch: BatchMetadata) -> list[_Call]:
        """The sequences of each attention call the backend accepts; the rest count as skipped."""
        return attention_calls(self.caps, batch, self.skips)

    def _run_layer(
        self, layer: int, batch: BatchMetadata, calls: list[_Call]
    ) -> tuple[F64, BatchMetadata, F64, list[str]]:
        """Write this step's K and V (with padding) on both sides, then run each attention call.

        Returns the attended rows' queries and their batch (what the references
        take, once the KV is compared), the backend's output for them, and its paths.
        """
        c = self.config
        key, value = self._new_kv(layer, batch)
        pad = self.step_index % 3  # padding slots (-1), then one row past the slot mapping
        junk_k, junk_v = padding_rows(c, self.step_index, layer, pad + 1)
        group = c.geometry.group_of(layer)
        slots = self._shift_slots(batch.slots(group)) + [PAD_SLOT] * pad
        self._write_kv(layer, np.concatenate([key, junk_k]), np.concatenate([value, junk_v]), slots)
        self.memory.write(layer, key, value, batch.slots(group))
        self._note_offset(max(slots))
        query = queries(c, self.step_index, layer, batch.num_tokens)
        variant = c.variant(layer)
        extra = {} if variant.is_plain else {"variant": variant}  # plain calls stay unchanged
        actual, paths = [], []
        for call in calls:
            sub = sub_batch(batch, call)
            rows = token_rows(batch, call)
            with recording() as launches:
                out = self._attention(
                    layer, query[rows], self._view(sub), (key[rows], value[rows]), extra
                )
            actual.append(out)
            reported = self._path(layer)
            decodes = sum(sub.query_len(i) == 1 for i in range(sub.num_seqs))
            self.coverage.note_step(num_seqs=sub.num_seqs, decodes=decodes, max_offset=0)
            paths.append(self._note_pairs(sub, variant, launches, reported, layer))
        attended = sub_batch(batch, [i for call in calls for i in call])
        q_all = query[token_rows(batch, [i for call in calls for i in call])]
        empty = np.zeros((0, query.shape[1], c.geometry.value_dim))
        got = np.concatenate(actual) if actual else empty
        return q_all, attended, got, paths

    def _reference(self, query: F64, batch: BatchMetadata, layer: int) -> tuple[F64, F64]:
        """The float64 and same-precision references, by the oracle this step's size picks."""
        if batch.num_seqs == 0:
            empty = np.zeros((0, query.shape[1], self.config.geometry.value_dim))
            return empty, empty
        c = self.config
        self._oracle_used = self.oracle.choose(step_cost(batch, c.num_heads), self.caps.device)
        try:
            return self._reference_by(query, batch, layer)
        except SetupError as e:  # the suite's limit, not the backend: out of Hypothesis untouched
            raise SuiteStopped(e) from e

    def _reference_by(self, query: F64, batch: BatchMetadata, layer: int) -> tuple[F64, F64]:
        c = self.config
        return reference_outputs(
            self.oracle,
            query,
            batch,
            self.memory,
            layer,
            scale=c.scale,
            variant=c.variant(layer),
            group=c.geometry.group_of(layer),
            dtype=c.dtype,
            quantized_kv=c.geometry.kv_dtype is not None,
            oracle=self._oracle_used,
            products=self.caps.products,
            kv_dtype=c.geometry.kv_dtype,
        )

    def _note_pairs(
        self,
        sub: BatchMetadata,
        variant: AttentionVariant,
        launches: Sequence[Launch],
        reported: str | None,
        layer: int,
    ) -> str:
        """The features of this call with the path it ran, observed where its launches or the
        backend say (:func:`~conformance.lockstep.pairs.path_run`), else the suite's plan; the
        path in words, as a failure of this call reports it."""
        g = self.config.geometry
        features = call_features(
            variant,
            g.kv_dtype,
            sub,
            grouped=g.num_groups > 1,
            large=self.base > 0,
            latent=g.is_latent,
        )
        paths = self.coverage.paths
        drawn = call_path(sub, variant.window, paths.split_keys)
        seen = observe(launches)
        run = path_run(sub, seen.parts, reported)
        if run is not None and run[0] in ("single-pass decode", "split-KV decode"):
            self._check_split_plan(sub, variant, run[0] == "split-KV decode", seen.parts, layer)
        ran, source = run or (drawn, "plan")
        paths.note_call(features, drawn, ran, source, seen.parts, reported)
        paths.note_launches(launches)
        parts = f" in {seen.parts} parts" if seen.parts and seen.parts > 1 else ""
        how = {
            "launches": f"read from its launches: {', '.join(dict.fromkeys(seen.kernels))}",
            "attention_path": "named by the backend's attention_path()",
            "plan": "the suite's plan, not observed",
        }[source]
        own = f"; the backend calls it {reported!r}" if reported and reported != ran else ""
        return f"{ran}{parts} ({how}){own}"

    def _check_split_plan(
        self,
        sub: BatchMetadata,
        variant: AttentionVariant,
        split: bool,
        parts: int | None,
        layer: int,
    ) -> None:
        """A decode whose observed split the declared plan (``capabilities.decode_split``)
        contradicts stops the run as a setup error naming both: the suite draws by the plan."""
        plan = self.caps.decode_split
        if plan is None:
            return
        w = variant.window
        keys = max(n if w is None else min(n, w) for n in sub.seq_lens)
        if split and keys < plan.min_keys:
            into = "" if parts is None else f" into {parts} parts"
            seen = f"split a decode of {keys:,} visible keys{into}"
        elif not split and sub.num_seqs == 1 and keys >= plan.min_keys:
            seen = f"ran a lone decode of {keys:,} visible keys in a single pass"
        else:
            return
        raise SuiteStopped(
            SetupError(
                f"capabilities.decode_split says the kernel {plan.describe()}, but at step "
                f"{self.step_index}, layer {layer} it {seen}: declare the plan the kernel runs"
            )
        )

    def _oracle_name(self) -> str:
        name = ORACLE_NAMES[self._oracle_used]
        return name if self._oracle_used == SPEC else f"{name} on {self.oracle.device}"

    def _path(self, layer: int) -> str | None:
        """The backend's own name of the path its last attention call ran, if it says."""
        path = getattr(self.backend, "attention_path", None)
        if path is None:
            return None
        name = self._call("attention_path", path)
        if not isinstance(name, str):
            self._fail(
                "shape",
                f"attention_path() returned {name!r} ({type(name).__name__}), not a str naming "
                "the path the last attention call ran",
                layer=layer,
            )
        return name

    def _new_kv(self, layer: int, batch: BatchMetadata) -> tuple[F64, F64]:
        keys, values = [], []
        for i, seq_id in enumerate(batch.seq_ids):
            k, v = self._truth.rows(seq_id, self.manager.tokens(seq_id), layer)
            new = slice(batch.seq_lens[i] - batch.query_len(i), batch.seq_lens[i])
            keys.append(k[new])
            values.append(v[new])
        return np.concatenate(keys), np.concatenate(values)

    def _layout(self, ran: Sequence[tuple[int, int]]) -> BatchMetadata:
        """The step's batch; with KV cache groups, validated and its released entries counted."""
        if self.groups is None:
            return build_batch(self.manager, ran)
        batch = self.groups.layout(ran)
        batch.validate(self.config.geometry.num_blocks)
        self.checks["batch metadata of KV cache groups validated"] += 1
        released = self.groups.released - self._released
        self._released = self.groups.released
        self.coverage.note_released(released, released_rows(batch))
        return batch

    def _held(self, seq_id: int, layer: int) -> tuple[tuple[int, ...], int]:
        """The table ``layer`` reads for ``seq_id``, and its first position in a held block."""
        if self.groups is None:
            return self.manager.block_table(seq_id), 0
        return self.groups.held(self.config.geometry.group_of(layer), seq_id)

    def _owners(self, group: int = 0) -> dict[int, tuple[int, int]]:
        """Slot -> (sequence, token) for every live token of KV cache ``group`` (the lowest
        sequence id if shared)."""
        if self.groups is not None:
            return self.groups.owners(group)
        owners: dict[int, tuple[int, int]] = {}
        b = self.manager.block_size
        for seq_id in sorted(self.manager.sequence_ids()):
            table = self.manager.block_table(seq_id)
            for pos in range(self.manager.num_tokens(seq_id)):
                owners.setdefault(table[pos // b] * b + pos % b, (seq_id, pos))
        return owners

    def _read(self, layer: int, blocks: list[int], backend_ids: bool = False) -> tuple[F64, F64]:
        """K and V of spec ``blocks`` (backend ids if ``backend_ids``), as the backend has them.

        The whole of a pool that is not large is read with ``read_cache`` (the
        contract's method); some blocks, or any of a large pool, with
        ``read_blocks`` when the backend has it.
        """
        g = self.backend_geometry
        ids = blocks if backend_ids else [b + self.base for b in blocks]
        if self._device is not None:
            return self._read_device(layer, ids)
        whole = not self.base and len(ids) == g.num_blocks and not backend_ids
        if self._read_blocks is not None and not whole:
            got = self._call("read_blocks", self._read_blocks, layer, ids)
            return self._shaped(f"read_blocks({layer}, ...)", got, len(ids), layer)
        got = self._call("read_cache", self.backend.read_cache, layer)
        k, v = self._shaped(f"read_cache({layer})", got, g.num_blocks, layer)
        return (k, v) if whole else (k[ids], v[ids])

    def _shaped(self, what: str, got: object, blocks: int, layer: int) -> tuple[F64, F64]:
        """A read's K and V as float64, or a failure naming the shape it had."""
        g = self.backend_geometry
        pair = got if isinstance(got, tuple | list) and len(got) == 2 else (got, got)
        out = []
        for name, width, x in zip(kv_parts(g), g.kv_widths, pair, strict=True):
            x = _f64(x)
            shape = (blocks, g.block_size, g.num_kv_heads, width)
            if x.shape != shape:
                self._fail(
                    "shape",
                    f"{what} {name} has shape {x.shape}, expected {shape}"
                    + latent_part_note(g, name),
                    layer=layer,
                )
            out.append(x)
        return out[0], out[1]

    # -- the contract's calls: numpy, or device-resident (conformance/judges/device_contract.py) --

    def _device_contract(self) -> DeviceContract | None:
        """The device contract's converter when the backend declares it; its checks first.

        Under it the suite reads back only what it compares: the blocks each step
        wrote or copied into (and their neighbours), the whole pool every
        :data:`SWEEP_EVERY` steps and at :meth:`finish`, as for a large pool.
        """
        if not uses_device_contract(self.caps):
            return None
        problem = setup_problem(self.backend, self.caps)
        if problem:
            raise ValueError(f"{self.caps.name}: {problem}")
        self._whole = False
        return DeviceContract(self.caps, self.backend_geometry)

    def _write_kv(self, layer: int, key: F64, value: F64, slots: list[int]) -> None:
        """One ``write_kv`` in the backend's contract: float32 arrays, or device tensors."""
        dc = self._device
        if dc is None:
            self._call("write_kv", self.backend.write_kv, layer, _f32(key), _f32(value), slots)
            return
        handed: dict[str, object] = {
            "key": dc.activations(key),
            "value": dc.activations(value),
            "slot_mapping": dc.slots(self.step_index, slots),
        }
        self._call("write_kv", self.backend.write_kv, layer, *handed.values())
        self._unchanged("write_kv", handed, layer)

    def _attention(
        self,
        layer: int,
        query: F64,
        batch: BatchMetadata,
        new_kv: tuple[F64, F64],
        extra: Mapping[str, object],
    ) -> F64:
        """One ``attention`` call in the backend's contract; its output checked, as float64.

        Under the device contract it also gets the batch's device arrays and the
        call's new K and V (``arrays=``, ``key=``, ``value=``).
        """
        dc, scale = self._device, self.config.scale
        g = self.config.geometry
        shape = (*query.shape[:2], g.value_dim)  # latent: [T, H, latent_dim], not the query's
        if dc is None:
            got = self._call(
                "attention", self.backend.attention, layer, _f32(query), batch, scale, **extra
            )
            out = _f64(got)
            if out.shape != shape:
                self._fail(
                    "shape",
                    f"attention returned shape {out.shape}, expected {shape}"
                    + latent_output_note(g),
                    layer,
                )
            return out
        q = dc.activations(query)
        handed: dict[str, object] = {
            "arrays": dc.metadata(self.step_index, batch),
            "key": dc.activations(new_kv[0]),
            "value": dc.activations(new_kv[1]),
        }
        got = self._call(
            "attention", self.backend.attention, layer, q, batch, scale, **handed, **extra
        )
        self._unchanged("attention", {"query": q, **handed}, layer)
        try:
            return dc.output("attention", got, shape)
        except ContractMismatch as err:
            self._fail("shape", f"{err}{latent_output_note(g)}", layer=layer)

    def _read_device(self, layer: int, ids: list[int]) -> tuple[F64, F64]:
        """Backend blocks ``ids`` through ``read_blocks``, checked, as float64 on the host."""
        assert self._device is not None and self._read_blocks is not None
        g = self.backend_geometry
        got = self._call("read_blocks", self._read_blocks, layer, ids)
        k, v = ((len(ids), g.block_size, g.num_kv_heads, w) for w in g.kv_widths)
        try:
            return self._device.blocks(
                f"read_blocks({layer}, ...)", got, k, value_shape=v, names=kv_parts(g)
            )
        except ContractMismatch as err:
            self._fail("shape", str(err), layer=layer)

    def _unchanged(self, what: str, handed: dict[str, object], layer: int) -> None:
        assert self._device is not None
        problem = self._device.changed(what, handed)
        if problem:
            self._fail("input", problem, layer=layer)

    def _shift_slots(self, slots: Sequence[int]) -> list[int]:
        shift = self.base * self.config.geometry.block_size
        return [s + shift if s != PAD_SLOT else s for s in slots]

    def _shift_copies(self, copies: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(s + self.base, d + self.base) for s, d in copies]

    def _view(self, batch: BatchMetadata) -> BatchMetadata:
        """``batch`` as the backend sees it: block ids shifted into a large pool, tables as wide
        as it asks (:mod:`conformance.lockstep.tables`)."""
        return widen(self._shifted(batch), self.caps.table_width)

    def _shifted(self, batch: BatchMetadata) -> BatchMetadata:
        if not self.base:
            return batch
        return BatchMetadata(
            block_size=batch.block_size,
            seq_ids=batch.seq_ids,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_tables=self._shift_tables(batch.block_tables),
            slot_mapping=tuple(self._shift_slots(batch.slot_mapping)),
            positions=batch.positions,
            copies=tuple(self._shift_copies(batch.copies)),
            extra_groups=tuple(
                GroupLayout(
                    self._shift_tables(e.block_tables), tuple(self._shift_slots(e.slot_mapping))
                )
                for e in batch.extra_groups
            ),
        )

    def _shift_tables(self, tables: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(b + self.base if b != PAD_BLOCK else b for b in row) for row in tables)

    def _note_offset(self, slot: int) -> None:
        """The last KV element of backend ``slot``: the largest offset, for the coverage report."""
        g = self.config.geometry
        last = (slot + 1) * g.num_kv_heads * g.head_dim - 1
        self.coverage.note_step(num_seqs=0, decodes=0, max_offset=last)

    def _call(self, what: str, fn: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        """One backend call, through the guard (:mod:`conformance.judges.guard`) and bounds check.

        A bounds violation is reported before a fault of the same call: a
        refused access may be what made the backend raise.
        """
        fault: BackendFault | None = None
        start = time.perf_counter()
        with self._watch(what, args) as seen:
            try:
                result = self.guard.call(what, fn, *args, **kwargs)
            except BackendFault as err:
                fault = err
        spent = time.perf_counter() - start
        self.call_seconds[what] = self.call_seconds.get(what, 0.0) + spent
        if seen is not None and seen.violations:
            self._fail("bounds", _bounds_detail(seen), layer=seen.layer)
        if fault is not None:
            self._fail(fault.kind, fault.detail, layer=fault.layer)
        return result

    def _watch(self, what: str, args: tuple[object, ...]) -> AbstractContextManager[Watched | None]:
        """The bounds checker's watch over a call that launches kernels; else nothing."""
        if self.bounds is None or what not in BOUNDS_CHECKED:
            return nullcontext()
        layer = args[0] if what != "copy_blocks" and isinstance(args[0], int) else None
        batch = args[2] if what == "attention" and isinstance(args[2], BatchMetadata) else None
        return self.bounds.watch(what, layer, batch)

    def _named(self, diff: Difference, layer: int) -> Difference:
        """``diff`` with the layer's attention variant and KV dtype (and fp8 scales) named."""
        c = self.config
        kind = f"{describe(c.variant(layer))}; {describe_kv(c.geometry, layer)}"
        return replace(diff, detail=f"{diff.detail} [layer {layer}: {kind}]")

    def _fail(self, what: str, detail: str, layer: int | None = None) -> NoReturn:
        raise ConformanceFailure(
            Difference(what, self.step_index, detail, layer=layer), self.log, self.config
        )


_Call = list[int]
"""The batch indices of the sequences of one attention call."""


def _memory(g: KVGeometry, oracle: OracleChoice) -> KVMemory:
    """The spec's KV memory; kept on the oracle's device too when that is not the host, or when
    the pool is held lazily (sending the blocks a step reads from a lazy pool at every step
    cost the fast reference more than its arithmetic, at 64 x 2,048)."""
    dims = (g.num_layers, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
    if oracle.resident or held_lazily(*dims[1:]):
        return ResidentKV(
            *dims,
            device=oracle.device,
            kv_dtype=g.kv_dtype,
            kv_scales=g.kv_scales,
            latent_dim=g.latent_dim,
        )
    return KVMemory(*dims, kv_dtype=g.kv_dtype, kv_scales=g.kv_scales, latent_dim=g.latent_dim)


def _bounds_detail(seen: Watched) -> str:
    """A bounds failure's detail: the call's first violation, and how many more it had.

    >>> from conformance.bounds.checker import Violation
    >>> v = Violation("attention", 0, "k", 1, "load", "outside", "t", "int32 [2]", False,
    ...               2, 1, 1, 1, (0,))
    >>> detail = _bounds_detail(Watched("attention", 0, violations=[v, v]))
    >>> detail.split(": ")[0]
    'a kernel accessed memory it may not (bounds check)'
    >>> detail.split("; ")[-1]
    'first by program (0,): element 2, 1 past the end (worst 1) (and 1 more violation in this call)'
    """
    first, more = seen.violations[0], len(seen.violations) - 1
    tail = f" (and {more} more violation{'s' if more > 1 else ''} in this call)" if more else ""
    return f"a kernel accessed memory it may not (bounds check): {first.describe()}{tail}"


def _written_blocks(batch: BatchMetadata) -> list[int]:
    """Blocks a step may change (written or copied into), with their neighbours."""
    b = batch.block_size
    touched = {s // b for g in range(batch.num_groups) for s in batch.slots(g) if s >= 0}
    touched |= {dst for _, dst in batch.copies}
    return sorted({x for t in touched for x in (t - 1, t, t + 1) if x >= 0})


def _first_touched(
    table: Sequence[int], touched: frozenset[int], start: int, num_tokens: int, b: int
) -> int:
    """The first position ``>= start`` of ``num_tokens`` in a block of ``touched``; else
    ``num_tokens``."""
    for j in range(start // b, -(-num_tokens // b)):
        if table[j] in touched:
            return max(start, j * b)
    return num_tokens


def _same(a: F64, b: F64) -> NDArray[np.bool_]:
    """Elementwise equality in which NaN equals NaN."""
    out: NDArray[np.bool_] = (a == b) | (np.isnan(a) & np.isnan(b))
    return out


def _f64(x: object) -> F64:
    out: F64 = np.asarray(x, dtype=np.float64)
    return out


def _f32(x: F64) -> NDArray[np.float32]:
    return x.astype(np.float32)
