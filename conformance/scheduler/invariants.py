"""Scheduler invariants, checked every step, against any :class:`spec.scheduler.Scheduler`.

A scheduler plugs in like a backend: give :func:`run_checked` a factory that
builds it from a :class:`~spec.scheduler.SchedulerConfig`, some requests and
their arrival steps. It drives the scheduler, and an *executor* turns each
step's decision into sampled tokens. The default executor needs no model: it
"samples" token ``j`` of sample ``i`` of a request as a fixed function of
``(request, i, j)``. The scheduler suite also plugs in a model-backed executor
(:mod:`conformance.scheduler.engine`) that runs the decision through a
paged KV cache, so the same run also checks token-exact equivalence. After
every step it checks:

* scheduled tokens <= ``max_num_batched_tokens``; running sequences <= ``max_num_seqs``;
* no running sequence is skipped while budget is left (a victim's removal must
  not make the loop skip the next sequence);
* every scheduled token has a slot: in the pool, no two tokens in one slot,
  and exactly where the sequence's block table puts its position;
* every input token is the sequence's token at that position (as the block
  manager holds it: prompt, then what was sampled);
* the block manager's and the pool's own invariants (``check_integrity``);
* finished and aborted requests hold no blocks, from the step they finish;
* the scheduler's own calls do not raise, nor leave by any other exit
  (``sys.exit``, a ``KeyboardInterrupt`` of its own, any ``BaseException``):
  preempting a victim that already has slots this step, for one, breaks the
  batch it is building;
* its calls return the protocol's types (a :class:`SchedulerOutput` from
  ``step``, :class:`FinishedRequest` objects from ``update`` and ``result``, a
  bool from ``has_unfinished``);
* the configuration is not changed: the checker judges against its own copy,
  the scheduler is built from another, and the scheduler's ``config`` must
  stay equal to it (a scheduler that raises its own ``max_num_seqs`` would
  otherwise be judged by the limit it chose);
* progress: a step that has work left computes a token or frees blocks (no deadlock);
* bounded wait: under FCFS no request is first scheduled before one that arrived
  earlier, and every request finishes within a step bound;
* speculative rows (``config.num_speculative_tokens > 0``, a scheduler with
  ``propose``): the run proposes drafts for every running sequence before each
  step, some of them wrong; a row the step verifies carries ``1 + k`` tokens,
  ``k`` at most ``num_speculative_tokens``, the drafts exactly the proposal's
  first ``k`` (the budget rule above counts all of them); the executor accepts
  the drafts greedy verification keeps (:func:`spec.speculative.accepted_prefix`);
  between steps no sequence has drafts in flight; at the end the scheduler's
  metrics report exactly the drafts verified and accepted;
* at the end: no blocks leaked, sequence ids unique to one request, and each
  sample generated exactly what it generates alone, cut at its stop token or
  its length.

Every violation raises :class:`SchedulerInvariantError` naming the step and the
rule; :attr:`RunReport.checks` counts each rule's checks, :attr:`RunReport.paths`
the paths the run took (preemptions, swaps, forks, prefix hits, ...).

>>> from spec.scheduler import ContinuousScheduler
>>> config = SchedulerConfig(num_blocks=4, block_size=3, max_num_batched_tokens=4)
>>> report = run_checked(ContinuousScheduler, config, [
...     Request(request_id=0, prompt=(1, 2, 3, 4, 5), max_new_tokens=3),
...     Request(request_id=1, prompt=(6,), max_new_tokens=2, n=2)])
>>> report.steps, report.paths["forked samples"], report.checks["token budget"]
(4, 1, 4)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from typing import TypeVar, cast

import numpy as np

from conformance.scheduler.executors import (
    Executor,
    ExecutorFactory,
    TokenFn,
    TokenFnExecutor,
    default_tokens,
)
from conformance.scheduler.rules import (
    ACCEPTANCE,
    BOUNDED,
    BUDGET,
    CALLS,
    CONFIG,
    DRAFTS,
    EXECUTABLE,
    FCFS,
    FINISHED,
    INPUTS,
    INTEGRITY,
    LEAK,
    NO_SKIP,
    PROGRESS,
    RETURNS,
    SEATS,
    SLOTS,
    UNIQUE_IDS,
    VERIFIED,
    RunReport,
    SchedulerInvariantError,
)
from conformance.watchdog import CallTimeout, current_watch
from spec.block_manager import cdiv
from spec.request import Request
from spec.scheduler import FinishedRequest, Scheduler, SchedulerConfig, SchedulerOutput

T = TypeVar("T")


def run_checked(
    make: Callable[[SchedulerConfig], Scheduler],
    config: SchedulerConfig,
    requests: Sequence[Request],
    arrivals: Mapping[int, int] | None = None,
    *,
    aborts: Mapping[int, int] | None = None,
    tokens: TokenFn = default_tokens,
    max_steps: int | None = None,
    executor: ExecutorFactory | None = None,
) -> RunReport:
    """Drive ``make(config)`` through ``requests``, checking every step.

    ``arrivals[id]``: the step before which the request is submitted (default 0).
    ``aborts[id]``: the step before which it is aborted, if it is still in flight.
    ``executor`` builds what executes each step (default: ``tokens``, no model).
    """
    own = copy.deepcopy(config)  # the checker's: whatever the scheduler does to its own
    sched = make(copy.deepcopy(config))
    by_id = {r.request_id: r for r in requests}
    run = _Run(sched, RunReport(), own)
    run.check_config()
    run.executor = (
        executor(sched, by_id) if executor is not None else TokenFnExecutor(by_id, tokens)
    )
    arrive = dict(arrivals or {})
    pending = sorted(requests, key=lambda r: arrive.get(r.request_id, 0))
    bound = max_steps if max_steps is not None else _step_bound(requests, arrive)
    while pending or run.has_unfinished():
        while pending and arrive.get(pending[0].request_id, 0) <= run.report.steps:
            request = pending.pop(0)
            run.call(partial(sched.submit, request), f"submit(request {request.request_id})")
            run.submitted.append(request.request_id)
        run.abort_due(aborts or {})
        run.check(run.report.steps < bound, BOUNDED, f"not finished within {bound} steps")
        run.step()
    run.check_end(requests)
    return run.report


@dataclass
class _Run:
    """One checked run: the scheduler, what it has done so far, and the checks."""

    sched: Scheduler
    report: RunReport
    config: SchedulerConfig  # the checker's own copy: every limit is judged against it
    executor: Executor | None = None
    submitted: list[int] = field(default_factory=list)
    first_row: dict[int, int] = field(default_factory=dict)  # seq id -> first step it ran
    proposals: dict[int, tuple[int, ...]] = field(default_factory=dict)  # this step's drafts
    drafted: int = 0  # drafts verified over the run
    accepted: int = 0  # of which accepted
    sampled_at: dict[tuple[int, int, int], int] = field(default_factory=dict)

    def check(self, ok: bool, rule: str, detail: str, step: int | None = None) -> None:
        self.report.checks[rule] += 1
        if not ok:
            raise SchedulerInvariantError(rule, self.report.steps if step is None else step, detail)

    def call(self, fn: Callable[[], T], what: str, rule: str = CALLS) -> T:
        """Run a scheduler call; its own crash is a violation too (it broke its own state).

        Any exit counts: an exception, ``sys.exit``, any other ``BaseException``,
        and a ``KeyboardInterrupt`` unless the run's watch says the user pressed
        Ctrl-C (:mod:`conformance.watchdog`); a per-call timeout passes through.
        """
        self.report.checks[rule] += 1
        try:
            return fn()
        except (SchedulerInvariantError, CallTimeout):
            raise
        except KeyboardInterrupt as e:
            watch = current_watch()
            if watch is None or watch.is_users():
                raise
            detail = f"{what} raised KeyboardInterrupt itself (no Ctrl-C was pressed)"
            raise SchedulerInvariantError(rule, self.report.steps, detail) from e
        except SystemExit as e:
            detail = f"{what} called sys.exit({e.code!r})"
            raise SchedulerInvariantError(rule, self.report.steps, detail) from e
        except BaseException as e:
            detail = f"{what} raised {type(e).__name__}: {e}"
            raise SchedulerInvariantError(rule, self.report.steps, detail) from e

    def returned(
        self, value: object, want: type | tuple[type, ...], what: str, verb: str = "returned"
    ) -> None:
        """Check that ``what`` returned a ``want`` (the protocol's type), under :data:`RETURNS`."""
        names = " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        self.check(
            isinstance(value, want),
            RETURNS,
            f"{what} {verb} {shown} ({type(value).__name__}), not a {names}",
        )

    def has_unfinished(self) -> bool:
        busy = self.call(self.sched.has_unfinished, "has_unfinished()")
        self.returned(busy, (bool, np.bool_), "has_unfinished()")
        return bool(busy)

    def check_config(self) -> None:
        """The scheduler's configuration is still the one it was built with (the checker's copy)."""
        self.check(
            self.sched.config == self.config,
            CONFIG,
            f"the scheduler's config changed: it was built with {self.config}, it now has "
            f"{self.sched.config}",
        )

    def integrity(self) -> None:
        self.report.checks[INTEGRITY] += 1
        try:
            self.sched.manager.check_integrity()
        except AssertionError as e:
            raise SchedulerInvariantError(INTEGRITY, self.report.steps, str(e)) from e

    def abort_due(self, aborts: Mapping[int, int]) -> None:
        """Abort each submitted, unfinished request whose abort step has come."""
        for rid in self.submitted:
            if aborts.get(rid) == self.report.steps and rid not in self.report.results:
                self.call(partial(self.sched.abort, rid), f"abort({rid})")
                self.report.paths["aborts"] += 1
                done = self.call(partial(self.sched.result, rid), f"result({rid})")
                self.returned(done, FinishedRequest, f"result({rid})")
                self.finished(done)
                self.integrity()

    def finished(self, done: FinishedRequest) -> None:
        self.report.results[done.request_id] = done
        for seq_id in done.seq_ids:
            self.check(
                seq_id not in self.sched.manager,
                FINISHED,
                f"request {done.request_id} finished but sequence {seq_id} holds blocks",
            )

    def step(self) -> None:
        sched, report = self.sched, self.report
        busy = self.has_unfinished()
        before = set(sched.manager.sequence_ids())
        self.propose()
        out = self.call(sched.step, "step()")
        self.returned(out, SchedulerOutput, "step()")
        self.check_config()
        self.check_step(out, busy=busy)
        self.check_drafts(out)
        self.count_paths(out, before)
        assert self.executor is not None
        execute = partial(self.executor.execute, out)
        if isinstance(self.executor, TokenFnExecutor):  # nothing to execute: no check
            sampled = execute()
        else:
            sampled = self.call(execute, f"executing step {out.step}", EXECUTABLE)
        for s in out.samples:
            self.sampled_at[(s.request_id, s.sample_index, s.position)] = report.steps
        # a speculative row's value is a tuple: only a scheduler that emitted drafts gets one
        update = cast(Callable[[Mapping[int, object]], list[FinishedRequest]], sched.update)
        finished = self.call(partial(update, sampled), "update()")
        self.returned(finished, (list, tuple), "update()")
        for done in finished:
            self.returned(done, FinishedRequest, "update()", "returned a list holding")
            self.finished(done)
        self.integrity()
        if out.drafts:
            self.accepted += sum(len(_tokens(sampled[s])) - 1 for s, _ in out.drafts)
            m = sched.manager
            drafting = [s for s in m.sequence_ids() if m.num_drafts(s)]
            self.check(not drafting, VERIFIED, f"sequences {drafting} still hold drafts")
        report.steps += 1

    def propose(self) -> None:
        """Offer drafts to every running sequence: the true next tokens, one in three wrong.

        Only with the model-free executor (it knows the true tokens) and a
        scheduler that takes proposals (``propose``) and speculates.
        """
        self.proposals = {}
        k = self.sched.config.num_speculative_tokens
        propose = getattr(self.sched, "propose", None)
        sequences = getattr(self.sched, "sequences", None)
        ex = self.executor
        if not k or propose is None or sequences is None or not isinstance(ex, TokenFnExecutor):
            return
        running = set(self.sched.manager.sequence_ids())
        for seq in sequences():
            if seq.seq_id not in running or not seq.forked:
                continue
            start, request = seq.num_generated, seq.request
            drafts = [ex.tokens(request, seq.sample_index, start + j) for j in range(k)]
            drafts = [
                (t + 1) % 61 if (seq.seq_id + self.report.steps + j) % 3 == 0 else t
                for j, t in enumerate(drafts)
            ]
            self.call(partial(propose, seq.seq_id, drafts), f"propose({seq.seq_id}, ...)")
            self.proposals[seq.seq_id] = tuple(drafts)

    def check_drafts(self, out: SchedulerOutput) -> None:
        """Each speculative row: ``1 + k`` tokens ending in the first ``k`` proposed drafts."""
        b, k = out.batch, self.sched.config.num_speculative_tokens
        for seq_id, drafts in out.drafts:
            i = b.seq_ids.index(seq_id) if seq_id in b.seq_ids else None
            proposed = self.proposals.get(seq_id, ())
            row = (
                () if i is None else out.token_ids[b.query_start_loc[i] : b.query_start_loc[i + 1]]
            )
            self.check(
                i is not None
                and 0 < len(drafts) <= k
                and tuple(drafts) == proposed[: len(drafts)]
                and len(row) == 1 + len(drafts)
                and tuple(row[1:]) == tuple(drafts),
                DRAFTS,
                f"sequence {seq_id}: drafts {tuple(drafts)} in a row of tokens {tuple(row)}; "
                f"proposed {proposed}, at most {k} drafts, one verified token before them",
            )
            self.drafted += len(drafts)
            self.report.paths["speculative rows"] += 1

    def check_step(self, out: SchedulerOutput, *, busy: bool) -> None:
        cfg, m, b = self.config, self.sched.manager, out.batch
        self.check(
            b.num_tokens <= cfg.max_num_batched_tokens,
            BUDGET,
            f"{b.num_tokens} tokens scheduled, budget {cfg.max_num_batched_tokens}",
        )
        self.check(
            len(out.token_ids) == b.num_tokens, INPUTS, "token_ids and batch disagree in length"
        )
        running = len(m.sequence_ids())
        self.check(
            b.num_seqs <= cfg.max_num_seqs and running <= cfg.max_num_seqs,
            SEATS,
            f"{b.num_seqs} scheduled, {running} running; max_num_seqs {cfg.max_num_seqs}",
        )
        self.check_slots(out)
        idle = set(m.sequence_ids()) - set(b.seq_ids)
        self.check(
            not idle or b.num_tokens == cfg.max_num_batched_tokens,
            NO_SKIP,
            f"running sequences {sorted(idle)} skipped with "
            f"{cfg.max_num_batched_tokens - b.num_tokens} tokens of budget left",
        )
        progress = b.num_tokens > 0 or out.preempted or out.swap_out or out.aborted
        self.check(
            bool(progress) or not busy,
            PROGRESS,
            "work left, but no token computed and nothing freed",
        )
        self.integrity()
        report = self.report
        report.tokens += b.num_tokens
        report.preemptions += len(out.preempted)
        report.swaps += len(out.swap_out) + len(out.swap_in)
        report.max_running = max(report.max_running, running)

    def check_slots(self, out: SchedulerOutput) -> None:
        m, b, cfg = self.sched.manager, out.batch, self.config
        num_slots = cfg.num_blocks * cfg.block_size
        slots = b.slot_mapping
        self.check(len(set(slots)) == len(slots), SLOTS, "two scheduled tokens share a slot")
        for i, seq_id in enumerate(b.seq_ids):
            self.check(seq_id in m, SLOTS, f"sequence {seq_id} is scheduled but holds no blocks")
            table = m.block_table(seq_id)
            self.check(
                len(table) == cdiv(b.seq_lens[i], b.block_size),
                SLOTS,
                f"sequence {seq_id}: {len(table)} blocks for {b.seq_lens[i]} tokens",
            )
            tokens = m.tokens(seq_id)
            for j in range(b.query_start_loc[i], b.query_start_loc[i + 1]):
                pos, slot = b.positions[j], slots[j]
                inside = 0 <= pos < len(tokens)
                self.check(
                    inside and 0 <= slot < num_slots and slot == m.slot(seq_id, pos),
                    SLOTS,
                    f"sequence {seq_id} position {pos}: slot {slot}, table says "
                    f"{m.slot(seq_id, pos) if inside else 'nothing'}",
                )
                self.check(
                    out.token_ids[j] == tokens[pos],
                    INPUTS,
                    f"sequence {seq_id} position {pos}: input token {out.token_ids[j]}, "
                    f"the sequence holds {tokens[pos]} there",
                )

    def count_paths(self, out: SchedulerOutput, before: set[int]) -> None:
        """Which hard paths this step took; ``before``: the sequences holding blocks before it."""
        paths, b = self.report.paths, out.batch
        swapped_out = {s.seq_id for s in out.swap_out}
        swapped_in = {s.seq_id for s in out.swap_in}
        paths["preemptions by recomputation"] += len(set(out.preempted) - swapped_out)
        paths["preemptions by swapping"] += len(swapped_out)
        paths["swap-ins"] += len(swapped_in)
        paths["copy-on-write copies"] += len(b.copies)
        paths["forked samples"] += sum(s.sample_index > 0 and s.position == 0 for s in out.samples)
        for i, seq_id in enumerate(b.seq_ids):
            n, context = b.query_len(i), b.seq_lens[i] - b.query_len(i)
            paths["multi-token rows (prefill chunks)" if n > 1 else "single-token rows"] += 1
            if seq_id not in before and seq_id not in swapped_in and context > 0:
                paths["prefix-cache hit tokens"] += context
            self.first_row.setdefault(seq_id, self.report.steps)
        paths["steps that preempted"] += bool(out.preempted)

    def check_end(self, requests: Sequence[Request]) -> None:
        m, report = self.sched.manager, self.report
        self.check(not m.sequence_ids(), LEAK, f"sequences left holding blocks: {m.sequence_ids()}")
        self.check(m.pool.num_held == 0, LEAK, f"{m.pool.num_held} blocks leaked")
        assert self.executor is not None
        for r in requests:
            got = report.results.get(r.request_id)
            self.check(got is not None, BOUNDED, f"request {r.request_id} never finished")
            assert got is not None
            self.check_outputs(r, got, self.executor.alone(r))
        report.paths["requests finished"] += sum(not d.aborted for d in report.results.values())
        self.check_acceptance()
        self.check_unique_ids()
        if self.config.policy == "fcfs":
            self.check_fcfs()

    def check_outputs(
        self, r: Request, got: FinishedRequest, want: tuple[tuple[int, ...], ...]
    ) -> None:
        assert self.executor is not None
        if got.aborted:  # whatever it generated before the abort is a prefix of the truth
            want = tuple(w[: len(g)] for w, g in zip(want, got.outputs, strict=False))
        for i in range(max(len(want), len(got.outputs))):
            mine = got.outputs[i] if i < len(got.outputs) else None
            alone = want[i] if i < len(want) else None
            self.check(mine == alone, self.executor.rule, self.diff(r.request_id, i, mine, alone))

    def diff(
        self, rid: int, i: int, got: tuple[int, ...] | None, want: tuple[int, ...] | None
    ) -> str:
        """Where a sample's outputs first differ from its run alone, and at which step."""
        head = f"request {rid} sample {i} generated {got}, alone it generates {want}"
        if got is None or want is None:
            return head
        j = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if j is None:
            return f"{head} (lengths differ)"
        return f"{head} (token {j} differs; it was sampled at step {self.sampled_at[(rid, i, j)]})"

    def check_acceptance(self) -> None:
        """The scheduler's speculation metrics equal the drafts verified and accepted."""
        metrics = getattr(self.sched, "metrics", None)
        totals = getattr(metrics, "speculation_totals", None)
        if not self.drafted or totals is None:
            return
        got = totals()
        want = {"draft_tokens": self.drafted, "accepted_tokens": self.accepted}
        self.report.paths["drafts accepted"] += self.accepted
        self.report.paths["drafts rejected"] += self.drafted - self.accepted
        self.check(
            {key: got.get(key) for key in want} == want,
            ACCEPTANCE,
            f"metrics report {got}, the run verified {want}",
        )

    def check_unique_ids(self) -> None:
        owner: dict[int, int] = {}
        for rid, done in self.report.results.items():
            for seq_id in done.seq_ids:
                other = owner.setdefault(seq_id, rid)
                self.check(
                    other == rid,
                    UNIQUE_IDS,
                    f"sequence {seq_id} belongs to requests {other}, {rid}",
                )

    def check_fcfs(self) -> None:
        """No request first scheduled before one submitted earlier (aborted ones aside)."""
        results = self.report.results
        started = [rid for rid in self.submitted if not results[rid].aborted]
        firsts = [(rid, self.first_step(results[rid])) for rid in started]
        for (a, fa), (b, fb) in pairwise(firsts):
            self.check(
                fa is not None and fb is not None and fa <= fb,
                FCFS,
                f"FCFS: request {b} (first scheduled at step {fb}) overtook earlier request {a} "
                f"(first scheduled at step {fa})",
            )

    def first_step(self, done: FinishedRequest) -> int | None:
        steps = [self.first_row[s] for s in done.seq_ids if s in self.first_row]
        return min(steps, default=None)


def _tokens(sampled: int | tuple[int, ...]) -> tuple[int, ...]:
    return (sampled,) if isinstance(sampled, int) else sampled


def _step_bound(requests: Sequence[Request], arrivals: Mapping[int, int]) -> int:
    """Generous: every token of every sample, recomputed once per request, plus arrivals."""
    work = sum(r.n * (len(r.prompt) + r.max_new_tokens) for r in requests)
    return (work + 1) * (len(requests) + 2) + max(arrivals.values(), default=0)
