"""Serving metrics, per step and per request class, in steps and (given a clock) seconds.

The scheduler records what happens; this module only counts. Time is measured
in *steps* (one scheduler step = one forward pass): step ``s`` runs, and the
tokens it samples exist at its end. With a clock (the end time of every step,
from a cost model or a wall clock) the same events are reported in seconds.

* queue delay: from submission to the first step that computes any of its tokens;
* time to first token (TTFT): from submission to the end of the step that
  sampled its first token;
* inter-token latency (ITL): the mean gap between a sample's consecutive tokens.

A request submitted before step 0, first scheduled in step 2, whose tokens come
out of steps 3, 4 and 6:

>>> m = MetricsRecorder()
>>> m.on_submit(7, "chat", step=0, arrival_time=None)
>>> m.on_scheduled(7, step=2)
>>> for s in (3, 4, 6):
...     m.on_token(7, sample=0, step=s)
>>> m.on_finish(7, step=6)
>>> t = m.timelines[7]
>>> t.queue_delay_steps, t.ttft_steps, t.itl_steps
(2, 4, 1.5)
>>> ends = [0.5 * (s + 1) for s in range(7)]          # each step takes 0.5 s
>>> t.ttft_seconds(ends), t.itl_seconds(ends)
(2.0, 0.75)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from spec.errors import ArgumentTypeError, ArgumentValueError
from spec.validate import check_real, is_array


@dataclass(frozen=True)
class StepStats:
    """The pool and the queues at the end of one step's scheduling decision."""

    step: int  # the step's number, from 0
    num_seqs: int  # sequences computed this step
    num_tokens: int  # tokens computed this step (<= max_num_batched_tokens)
    num_waiting: int  # requests queued, not admitted (a static lobby too)
    num_running: int  # sequences admitted, holding device memory
    num_swapped: int  # sequences preempted to the host pool
    free_blocks: int  # no holder, no cached content
    cached_blocks: int  # no holder, but a reusable prefix (evictable)
    used_blocks: int  # held by some sequence
    tail_waste: int  # slots held by running sequences that hold no token
    allocation_failures: int  # times this step found too few blocks (then preempted or waited)
    preemptions: int  # sequences preempted this step
    swaps_out: int  # sequences swapped out this step
    swaps_in: int  # sequences swapped back in this step
    prefix_queried_tokens: int  # cumulative
    prefix_hit_tokens: int  # cumulative


@dataclass
class RequestTimeline:
    """The steps at which one request's events happened."""

    request_id: int  # the request
    request_class: str  # its Request.request_class
    arrival_step: int  # the step it was submitted before
    arrival_time: float | None  # seconds, if the request said; else from the clock
    first_scheduled_step: int | None = None  # first step that computed any of its tokens
    token_steps: dict[int, list[int]] = field(default_factory=dict)  # sample -> steps
    finish_step: int | None = None  # step it finished (or was aborted) in
    preemptions: int = 0  # times any of its samples was preempted
    aborted: bool = False  # cancelled by the client

    @property
    def first_token_step(self) -> int | None:
        return min((s[0] for s in self.token_steps.values() if s), default=None)

    @property
    def queue_delay_steps(self) -> int | None:
        s = self.first_scheduled_step
        return None if s is None else s - self.arrival_step

    @property
    def ttft_steps(self) -> int | None:
        s = self.first_token_step
        return None if s is None else s + 1 - self.arrival_step

    @property
    def itl_steps(self) -> float | None:
        gaps = [b - a for steps in self.token_steps.values() for a, b in pairwise(steps)]
        return sum(gaps) / len(gaps) if gaps else None

    def _start(self, ends: Sequence[float]) -> float:
        if self.arrival_time is not None:
            return self.arrival_time
        return ends[self.arrival_step - 1] if self.arrival_step > 0 else 0.0

    def queue_delay_seconds(self, ends: Sequence[float]) -> float | None:
        s = self.first_scheduled_step
        start_of = ends[s - 1] if s is not None and s > 0 else 0.0
        return None if s is None else max(0.0, start_of - self._start(ends))

    def ttft_seconds(self, ends: Sequence[float]) -> float | None:
        s = self.first_token_step
        return None if s is None else ends[s] - self._start(ends)

    def itl_seconds(self, ends: Sequence[float]) -> float | None:
        gaps = [
            ends[b] - ends[a] for steps in self.token_steps.values() for a, b in pairwise(steps)
        ]
        return sum(gaps) / len(gaps) if gaps else None


@dataclass(frozen=True)
class ClassSummary:
    """Means over the finished requests of one class (``None`` where nothing was measured)."""

    request_class: str  # the class these means are over
    num_requests: int  # finished normally: the means below are over these
    preemptions: int  # total over the class's finished requests
    queue_delay_steps: float | None  # submission to first scheduled step
    ttft_steps: float | None  # submission to the end of the first token's step
    itl_steps: float | None  # mean gap between consecutive tokens
    queue_delay_seconds: float | None = None  # the same in seconds, given a clock
    ttft_seconds: float | None = None  # given a clock
    itl_seconds: float | None = None  # given a clock
    num_aborted: int = 0  # left early: counted here, not in the means


def check_step_end_times(
    step_end_times: object, timelines: Iterable[RequestTimeline]
) -> tuple[float, ...]:
    """The clock of a run, checked against the requests it times; as a tuple of floats.

    Step ``s`` ends at ``step_end_times[s]`` seconds: every time is finite and
    ``>= 0`` (the run starts at 0), and the times never decrease (a step ends
    no earlier than the one before it). There is a time for every step a
    finished request was in, and a request's own ``arrival_time`` is no later
    than the end of the step it was submitted before. Raises
    :class:`~spec.errors.ArgumentValueError` (or ``ArgumentTypeError``) naming
    the entry.

    >>> check_step_end_times([0.5, 1.0], [])
    (0.5, 1.0)
    >>> check_step_end_times([1.0, 0.5], [])
    Traceback (most recent call last):
    ...
    spec.errors.ArgumentValueError: step_end_times[1] is 0.5, before step_end_times[0] = 1.0
    """
    if is_array(step_end_times) and step_end_times.ndim == 1:
        step_end_times = step_end_times.tolist()
    if isinstance(step_end_times, str | bytes) or not isinstance(step_end_times, Sequence):
        raise ArgumentTypeError(
            f"step_end_times must be a sequence of seconds, got {type(step_end_times).__name__}"
        )
    ends = tuple(
        check_real(f"step_end_times[{i}]", x, low=0.0) for i, x in enumerate(step_end_times)
    )
    if not ends:  # no clock: summarize reports steps only
        return ends
    for i in range(1, len(ends)):
        if ends[i] < ends[i - 1]:
            raise ArgumentValueError(
                f"step_end_times[{i}] is {ends[i]}, before step_end_times[{i - 1}] = {ends[i - 1]}"
            )
    for t in timelines:
        if t.finish_step is None:
            continue
        if t.finish_step >= len(ends):
            raise ArgumentValueError(
                f"step_end_times has {len(ends)} entries, but request {t.request_id} finished "
                f"in step {t.finish_step}"
            )
        a = t.arrival_step
        if t.arrival_time is not None and a < len(ends) and t.arrival_time > ends[a]:
            raise ArgumentValueError(
                f"request {t.request_id} arrived at {t.arrival_time}, after the end of step {a} "
                f"(step_end_times[{a}] = {ends[a]}) that it was submitted before"
            )
    return ends


def _mean(values: Sequence[float | int | None]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


class MetricsRecorder:
    """Collects :class:`StepStats` and one :class:`RequestTimeline` per request."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.timelines: dict[int, RequestTimeline] = {}
        self.speculation: dict[int, tuple[int, int]] = {}  # step -> (drafted, accepted)

    def on_submit(
        self, request_id: int, request_class: str, *, step: int, arrival_time: float | None
    ) -> None:
        self.timelines[request_id] = RequestTimeline(request_id, request_class, step, arrival_time)

    def on_scheduled(self, request_id: int, *, step: int) -> None:
        t = self.timelines[request_id]
        if t.first_scheduled_step is None:
            t.first_scheduled_step = step

    def on_token(self, request_id: int, *, sample: int, step: int) -> None:
        self.timelines[request_id].token_steps.setdefault(sample, []).append(step)

    def on_preempt(self, request_id: int) -> None:
        self.timelines[request_id].preemptions += 1

    def on_finish(self, request_id: int, *, step: int, aborted: bool = False) -> None:
        self.timelines[request_id].finish_step = step
        self.timelines[request_id].aborted = aborted

    def on_verify(self, *, step: int, drafted: int, accepted: int) -> None:
        """One sequence's drafts of ``step`` verified: ``accepted`` of ``drafted`` kept."""
        d, a = self.speculation.get(step, (0, 0))
        self.speculation[step] = (d + drafted, a + accepted)

    def add_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def summarize(self, step_end_times: Sequence[float] | None = None) -> list[ClassSummary]:
        """Per request class, over finished requests; seconds too when ``step_end_times``.

        Aborted requests are counted apart and kept out of the means.
        ``step_end_times`` are checked first (:func:`check_step_end_times`):
        finite, non-negative, never decreasing, one per step summarized, and no
        request arriving after the end of the step it was submitted before, so
        that no latency comes out negative or NaN.
        """
        if step_end_times is not None:
            step_end_times = check_step_end_times(step_end_times, self.timelines.values())
        by_class: dict[str, list[RequestTimeline]] = {}
        aborted: dict[str, int] = {}
        for t in self.timelines.values():
            if t.finish_step is not None and t.aborted:
                aborted[t.request_class] = aborted.get(t.request_class, 0) + 1
                by_class.setdefault(t.request_class, [])
            elif t.finish_step is not None:
                by_class.setdefault(t.request_class, []).append(t)
        out = []
        for name in sorted(by_class):
            ts = by_class[name]
            ends = step_end_times
            out.append(
                ClassSummary(
                    request_class=name,
                    num_requests=len(ts),
                    preemptions=sum(t.preemptions for t in ts),
                    queue_delay_steps=_mean([t.queue_delay_steps for t in ts]),
                    ttft_steps=_mean([t.ttft_steps for t in ts]),
                    itl_steps=_mean([t.itl_steps for t in ts]),
                    queue_delay_seconds=_mean([t.queue_delay_seconds(ends) for t in ts])
                    if ends
                    else None,
                    ttft_seconds=_mean([t.ttft_seconds(ends) for t in ts]) if ends else None,
                    itl_seconds=_mean([t.itl_seconds(ends) for t in ts]) if ends else None,
                    num_aborted=aborted.get(name, 0),
                )
            )
        return out

    def totals(self) -> dict[str, float]:
        """Whole-run pool figures: peak used blocks, failures, preemptions, prefix hit rate."""
        last = self.steps[-1] if self.steps else None
        q = last.prefix_queried_tokens if last else 0
        return {
            "steps": len(self.steps),
            "tokens": sum(s.num_tokens for s in self.steps),
            "peak_used_blocks": max((s.used_blocks for s in self.steps), default=0),
            "min_free_blocks": min(
                (s.free_blocks + s.cached_blocks for s in self.steps), default=0
            ),
            "max_tail_waste": max((s.tail_waste for s in self.steps), default=0),
            "allocation_failures": sum(s.allocation_failures for s in self.steps),
            "preemptions": sum(s.preemptions for s in self.steps),
            "swaps_out": sum(s.swaps_out for s in self.steps),
            "prefix_hit_rate": (last.prefix_hit_tokens / q) if last and q else 0.0,
            **self.speculation_totals(),
        }

    def speculation_totals(self) -> dict[str, float]:
        """Drafts verified, accepted, the acceptance rate (accepted / drafted) and the accepted
        drafts per step that verified any; empty when nothing was drafted (so a run without
        speculation reports exactly what it always did).

        >>> m = MetricsRecorder()
        >>> m.on_verify(step=3, drafted=4, accepted=3); m.on_verify(step=4, drafted=4, accepted=1)
        >>> m.speculation_totals()
        {'draft_tokens': 8, 'accepted_tokens': 4, 'acceptance_rate': 0.5, 'accepted_per_step': 2.0}
        """
        drafted = sum(d for d, _ in self.speculation.values())
        if not drafted:
            return {}
        accepted = sum(a for _, a in self.speculation.values())
        return {
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted,
            "accepted_per_step": accepted / len(self.speculation),
        }


def format_table(summaries: Sequence[ClassSummary], totals: dict[str, float]) -> str:
    """A plain-text table of per-class summaries and whole-run totals."""

    def f(x: float | None, scale: float = 1.0) -> str:
        return "-" if x is None else f"{x * scale:.2f}"

    rows = [
        "class        reqs  preempt  queue(steps)  ttft(steps)  itl(steps)  ttft(ms)  itl(ms)",
    ]
    for s in summaries:
        rows.append(
            f"{s.request_class:<12} {s.num_requests:>4}  {s.preemptions:>7}  "
            f"{f(s.queue_delay_steps):>12}  {f(s.ttft_steps):>11}  {f(s.itl_steps):>10}  "
            f"{f(s.ttft_seconds, 1e3):>8}  {f(s.itl_seconds, 1e3):>7}"
        )
    rows.append(
        "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in totals.items())
    )
    return "\n".join(rows)
