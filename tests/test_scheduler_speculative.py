"""The continuous scheduler with speculative decoding: budget, verification, metrics, output.

An engine loop with a deterministic toy target (the next token is a function of the
whole prefix) and a drafter that is right only some of the time. Speculation must
change nothing but the number of steps: every request's output equals plain greedy
decoding token for token; each step's tokens, ``1 + k`` per speculative decode, stay
within the budget; between steps no drafts are in flight and the integrity check holds;
the metrics report the acceptance rate. Bad input is refused, naming the argument, and
changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.errors import ArgumentValueError, InvalidRequestError
from spec.scheduler import ContinuousScheduler, Request, SchedulerConfig, SchedulerOutput
from spec.speculative import accepted_prefix

VOCAB = 5


def target(prefix: Sequence[int]) -> int:
    """The toy target model's greedy next token after ``prefix``."""
    return hashlib.sha256(repr(tuple(prefix)).encode()).digest()[0] % VOCAB


def drafter(prefix: Sequence[int], k: int, skill: int) -> list[int]:
    """``k`` drafts; right while ``hash(prefix) % 4 < skill``, then wrong."""
    out: list[int] = []
    seq = list(prefix)
    for _ in range(k):
        good = hashlib.sha256(repr(seq).encode()).digest()[1] % 4 < skill
        token = target(seq) if good else (target(seq) + 1) % VOCAB
        out.append(token)
        seq.append(token)
    return out


def serve(
    config: SchedulerConfig, requests: Sequence[Request], skill: int
) -> tuple[dict[int, tuple[int, ...]], ContinuousScheduler, list[SchedulerOutput]]:
    """Run to completion; propose drafts for every decoding sequence when ``k > 0``."""
    sched = ContinuousScheduler(config)
    for r in requests:
        sched.submit(r)
    outs = []
    while sched.has_unfinished():
        for seq in sched.sequences():
            if seq.seq_id in sched.cache.manager and config.num_speculative_tokens:
                sched.propose(seq.seq_id, drafter(seq.tokens, config.num_speculative_tokens, skill))
        out = sched.step()
        outs.append(out)
        assert out.batch.num_tokens <= config.max_num_batched_tokens
        drafts = dict(out.drafts)
        sampled: dict[int, int | tuple[int, ...]] = {}
        seqs = {s.seq_id: s for s in sched.sequences()}
        for slot in out.samples:
            prefix = list(seqs[slot.seq_id].tokens)
            if slot.seq_id in drafts:
                d = drafts[slot.seq_id]
                row = out.batch.seq_ids.index(slot.seq_id)
                assert out.batch.query_len(row) == 1 + len(d)
                targets = [target(prefix + list(d[:j])) for j in range(len(d) + 1)]
                sampled[slot.seq_id] = accepted_prefix(d, targets)[1]
            else:
                sampled[slot.seq_id] = target(prefix)
        sched.update(sampled)
        sched.check_integrity()
    results = {r.request_id: sched.result(r.request_id).outputs[0] for r in requests}
    return results, sched, outs


def _config(k: int, **kw: int) -> SchedulerConfig:
    base = {"num_blocks": 24, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    base.update(kw)
    return SchedulerConfig(**base, num_speculative_tokens=k)  # type: ignore[arg-type]


REQUESTS = st.lists(
    st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=7), st.integers(1, 9)),
    min_size=1,
    max_size=4,
)


@settings(max_examples=max(10, settings().max_examples // 3))
@given(
    work=REQUESTS,
    k=st.integers(1, 4),
    skill=st.integers(0, 4),
    block_size=st.sampled_from([1, 3, 4]),
)
def test_speculation_changes_only_the_number_of_steps(
    work: list[tuple[list[int], int]], k: int, skill: int, block_size: int
) -> None:
    requests = [Request(i, tuple(p), n) for i, (p, n) in enumerate(work)]
    plain, _, _ = serve(_config(0, block_size=block_size), requests, skill)
    spec, sched, outs = serve(_config(k, block_size=block_size), requests, skill)
    assert spec == plain
    totals = sched.metrics.totals()
    drafted = sum(len(d) for out in outs for _, d in out.drafts)
    if drafted:
        assert totals["draft_tokens"] == drafted
        assert 0.0 <= totals["acceptance_rate"] <= 1.0
    if skill == 4 and drafted:
        assert totals["acceptance_rate"] == 1.0
        assert len(outs) <= len(serve(_config(0, block_size=block_size), requests, skill)[2])


def test_the_budget_counts_one_plus_k_per_speculative_decode() -> None:
    """Budget 5, k 4: one decode takes all 5 tokens; a second running sequence waits."""
    config = _config(4, max_num_batched_tokens=5)
    sched = ContinuousScheduler(config)
    for i in range(2):
        sched.submit(Request(i, (1, 2), 8))
    out = sched.step()
    sched.update({s.seq_id: 0 for s in out.samples})
    for seq in (0, 1):
        sched.propose(seq, [1, 1, 1, 1])
    out = sched.step()
    assert out.scheduled == ((0, 5),) and out.drafts == ((0, (1, 1, 1, 1)),)
    assert out.batch.num_tokens == 5


def test_drafts_never_pass_max_new_tokens() -> None:
    sched = ContinuousScheduler(_config(4))
    sched.submit(Request(0, (1, 2), 3))
    out = sched.step()
    sched.update({0: 0})
    sched.propose(0, [0, 0, 0, 0])
    out = sched.step()
    assert out.drafts == ((0, (0,)),)  # 1 generated, room for 1 draft and the next token
    sched.update({0: (0, 4)})
    assert sched.result(0).outputs == ((0, 0, 4),)


def test_bad_input_is_refused_and_changes_nothing() -> None:
    with pytest.raises(ArgumentValueError, match="num_speculative_tokens"):
        _config(-1)
    sched = ContinuousScheduler(_config(2))
    sched.submit(Request(0, (1, 2), 8))
    with pytest.raises(ArgumentValueError, match="seq_id"):
        sched.propose(0, [1])  # not running yet
    out = sched.step()
    with pytest.raises(InvalidRequestError, match="propose"):
        sched.propose(0, [1])  # mid-step
    sched.update({0: 3})
    sched.propose(0, [1, 2])
    out = sched.step()
    held = sched.cache.pool.num_held
    for bad in ((1, 2, 3, 4), (2, 0), ()):
        with pytest.raises(ArgumentValueError, match=r"sampled\[0\]"):
            sched.update({0: bad})
        assert sched.cache.num_drafts(0) == 2 and sched.cache.pool.num_held == held
    sched.update({0: (1, 0)})  # one draft accepted, then the target's token
    assert sched.cache.num_drafts(0) == 0
    assert sched.cache.manager.tokens(0) == (1, 2, 3, 1)
    assert sched.metrics.speculation == {out.step: (2, 1)}
    sched.check_integrity()
