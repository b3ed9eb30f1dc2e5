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

The lockstep coordinates; each part owns one job, named for it:
:mod:`~conformance.lockstep.backend_calls` (every call of the backend, watched,
numpy or device tensors), :mod:`~conformance.lockstep.large_pool` (block ids
past 2^31 elements), :mod:`~conformance.lockstep.poison` (priming and poison),
:mod:`~conformance.lockstep.kv_check` (the caches compared, whole or where a
step wrote, fp8 ties accepted), :mod:`~conformance.lockstep.truth_check` (the
spec's memory against the ground truth), :mod:`~conformance.lockstep.output_check`
(outputs judged and explained), :mod:`~conformance.lockstep.paths_seen` (the
paths a call ran) and :mod:`~conformance.lockstep.speculation_rules`.

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
call that may launch kernels (:data:`~conformance.lockstep.backend_calls.BOUNDS_CHECKED`)
runs inside its
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

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np

from conformance.bounds.checker import BoundsChecker
from conformance.errors import SpecSideBug, SuiteStopped
from conformance.judges.coverage import Coverage
from conformance.judges.dtypes import F64
from conformance.judges.fp8_ties import TieNeighbours
from conformance.judges.guard import CallGuard
from conformance.judges.numerics import Margins
from conformance.judges.oracle import OracleChoice, oracle_for_run
from conformance.judges.resident_kv import ResidentKV
from conformance.lockstep.backend_calls import BackendCalls
from conformance.lockstep.calls import attention_calls, sub_batch, token_rows
from conformance.lockstep.example import ConformanceFailure, Example
from conformance.lockstep.group_memory import GroupMemory, describe_groups, released_rows
from conformance.lockstep.kv_check import WHOLE_POOL_SLOTS, KVCheck, written_blocks
from conformance.lockstep.large_pool import LargePool
from conformance.lockstep.output_check import OutputCheck
from conformance.lockstep.paths_seen import note_call
from conformance.lockstep.poison import Poison
from conformance.lockstep.speculation_rules import check_speculation
from conformance.lockstep.truth_check import TruthCheck
from conformance.lockstep.workload import (
    SequenceTruth,
    TokenKV,
    WorkloadConfig,
    padding_rows,
    queries,
)
from conformance.observe.launches import recording
from spec.backend import Backend
from spec.batch import BatchMetadata, build_batch
from spec.block_manager import PAD_SLOT, BlockManager
from spec.block_pool import BlockPool
from spec.errors import OutOfBlocksError
from spec.kv_geometry import KVGeometry
from spec.kv_memory import KVMemory, held_lazily

__all__ = ["ConformanceFailure", "Lockstep"]

_Call = list[int]
"""The batch indices of the sequences of one attention call."""


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
        self.backend = backend
        self.config = config
        self.groups = GroupMemory(config) if config.group_windows else None
        self._released = 0  # table entries released by windows, as last noted in the coverage
        manager_cls = getattr(backend, "planted_block_manager", BlockManager)
        self.manager = (
            manager_cls(g.num_blocks, g.block_size, enable_prefix_caching=config.prefix_caching)
            if self.groups is None
            else self.groups.manager  # group 0's: read it, the groups' memory drives it
        )
        self.truth = TokenKV(config)
        self.skips: Counter[str] = Counter() if skips is None else skips
        self.coverage = Coverage() if coverage is None else coverage
        checked = "" if bounds is None else f", bounds={bounds!r}"  # replays check the same
        log = [f"ls = Lockstep(backend, {config!r}{checked})"]
        self.example = Example(config, log, Counter() if checks is None else checks)
        self._truth = SequenceTruth(self.truth)
        self._clean = True
        self.guard = CallGuard() if guard is None else guard
        self.pool = LargePool(config.block_base, g.num_blocks, g.block_size)
        calls = {} if call_seconds is None else call_seconds
        self.calls = BackendCalls(backend, self.example, self.pool, self.guard, bounds, calls)
        self.caps = self.calls.caps
        self.oracle = oracle or oracle_for_run(self.caps.device)
        self.memory = _memory(g, self.oracle)
        self.ties = TieNeighbours(self.memory)
        self.kv = KVCheck(
            self.example, self.memory, self.ties, self.calls, self._owners, whole_pool_slots
        )
        self.spec_truth = TruthCheck(
            self.example, self.memory, self.manager, self._truth, self._held
        )
        margins = Margins() if margins is None else margins
        self.outputs = OutputCheck(self.example, self.memory, self.caps, self.oracle, margins)
        self.poison = Poison(
            self.example,
            self.calls,
            self.memory,
            self._write_spec,
            self._owners,
            self._pool,
            self._note_offset,
        )
        ratio = config.num_heads // g.num_kv_heads
        self.coverage.note_shape(
            head_dim=g.head_dim,
            block_size=g.block_size,
            num_kv_heads=g.num_kv_heads,
            gqa_ratio=ratio,
            dtype=g.dtype,
            latent=g.kv_widths if g.is_latent else None,
        )
        if self.groups is not None:
            self.coverage.note_group_example(describe_groups(config))
        self.guard.attach(self.example)  # the guard reports the workload with each call
        with self._op():
            self.calls.call("create_cache", backend.create_cache, self.backend_geometry)
            self.poison.prime()
            self._check_kv(None, None)

    @property
    def backend_geometry(self) -> KVGeometry:
        """The geometry the backend allocates: the spec's, or a large pool around it."""
        return self.pool.geometry(self.config.geometry)

    @property
    def log(self) -> list[str]:
        """The operations so far, each a line of Python: the replay script."""
        return self.example.log

    @property
    def checks(self) -> Counter[str]:
        return self.example.checks

    @property
    def step_index(self) -> int:
        return self.example.step_index

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
            self.example.step_index += 1
            batch = self._layout(ran)
            self.poison.unowned()
            self.calls.call("copy_blocks", self.backend.copy_blocks, self.pool.copies(batch.copies))
            self.memory.copy_blocks(batch.copies)
            self.ties.note_copies(batch.copies)
            calls = attention_calls(self.caps, batch, self.skips)
            layers = range(self.config.geometry.num_layers)
            ran_layers = [self._run_layer(layer, batch, calls) for layer in layers]
            # KV first: a wrong cache is the usual root cause of a wrong output. And the
            # references after it, from the KV that is there (an accepted fp8 neighbour).
            whole = self.kv.due(self.step_index)
            self._check_kv(None if whole else written_blocks(batch), batch.seq_ids)
            outputs = [
                (*self.outputs.references(query, batch_done, layer), got, paths)
                for layer, (query, batch_done, got, paths) in zip(layers, ran_layers, strict=True)
            ]
            self.outputs.check(batch, [i for call in calls for i in call], outputs)
            return [seq_id for seq_id, _ in ran]

    def verify(self, seq_id: int, num_accepted: int) -> None:
        """Keep ``num_accepted`` of ``seq_id``'s drafts (its step ran); reject the rest."""
        self.log.append(f"ls.verify({seq_id}, {num_accepted})")
        with self._op():
            if self.groups is not None:
                self.groups.cache.verify(seq_id, num_accepted)
            else:
                self.manager.verify(seq_id, num_accepted)
            check_speculation(self.example, self._managers(), seq_id)

    def rollback(self, seq_id: int) -> None:
        """Reject every draft of ``seq_id``: it returns to its verified tokens."""
        self.log.append(f"ls.rollback({seq_id})")
        with self._op():
            if self.groups is not None:
                self.groups.cache.rollback(seq_id)
            else:
                self.manager.rollback(seq_id)
            check_speculation(self.example, self._managers(), seq_id)

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
            self.outputs.finish()

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
        self.kv.compare(blocks)
        self.spec_truth.check(None if blocks is None else seq_ids, blocks)

    # -- internals ----------------------------------------------------------------

    @contextmanager
    def _op(self) -> Iterator[None]:
        """One operation: if anything escapes it, :meth:`finish` no longer judges the state."""
        self._clean = False
        yield
        self._clean = True

    def _write_spec(self, layer: int, key: F64, value: F64, slots: list[int]) -> None:
        """The spec's side of a write: its memory, and the fp8 ties beside it."""
        self.memory.write(layer, key, value, slots)
        self.ties.note_write(layer, key, value, slots)

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
            check_speculation(self.example, self._managers(), seq_id)
        return ran

    def _managers(self) -> tuple[BlockManager, ...]:
        return (self.manager,) if self.groups is None else self.groups.managers

    def _pool(self, group: int) -> BlockPool:
        manager = self.manager if self.groups is None else self.groups.managers[group]
        return manager.pool

    def _run_layer(
        self, layer: int, batch: BatchMetadata, calls: list[_Call]
    ) -> tuple[F64, BatchMetadata, F64, list[str]]:
        """Write this step's K and V (with padding) on both sides, then run each attention call.

        Returns the attended rows' queries and their batch (what the references
        take, once the KV is compared), the backend's output for them, and its paths.
        """
        c = self.config
        step = self.step_index
        key, value = self._new_kv(layer, batch)
        pad = step % 3  # padding slots (-1), then one row past the slot mapping
        junk_k, junk_v = padding_rows(c, step, layer, pad + 1)
        group = c.geometry.group_of(layer)
        slots = self.pool.slots(batch.slots(group)) + [PAD_SLOT] * pad
        self.calls.write_kv(
            layer, np.concatenate([key, junk_k]), np.concatenate([value, junk_v]), slots
        )
        self._write_spec(layer, key, value, list(batch.slots(group)))
        self._note_offset(max(slots))
        query = queries(c, step, layer, batch.num_tokens)
        variant = c.variant(layer)
        extra = {} if variant.is_plain else {"variant": variant}  # plain calls stay unchanged
        actual, paths = [], []
        for call in calls:
            sub = sub_batch(batch, call)
            rows = token_rows(batch, call)
            with recording() as launches:
                out = self.calls.attention(
                    layer, query[rows], self.calls.view(sub), (key[rows], value[rows]), extra
                )
            actual.append(out)
            reported = self.calls.attention_path(layer)
            decodes = sum(sub.query_len(i) == 1 for i in range(sub.num_seqs))
            self.coverage.note_step(num_seqs=sub.num_seqs, decodes=decodes, max_offset=0)
            paths.append(
                note_call(
                    self.example,
                    self.coverage.paths,
                    self.caps,
                    sub,
                    variant,
                    launches,
                    reported,
                    layer,
                    large=self.pool.base > 0,
                )
            )
        attended = sub_batch(batch, [i for call in calls for i in call])
        q_all = query[token_rows(batch, [i for call in calls for i in call])]
        empty = np.zeros((0, query.shape[1], c.geometry.value_dim))
        got = np.concatenate(actual) if actual else empty
        return q_all, attended, got, paths

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

    def _note_offset(self, slot: int) -> None:
        """The last KV element of backend ``slot``: the largest offset, for the coverage report."""
        g = self.config.geometry
        last = (slot + 1) * g.num_kv_heads * g.head_dim - 1
        self.coverage.note_step(num_seqs=0, decodes=0, max_offset=last)


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
