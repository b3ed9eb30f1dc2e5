"""The memory side: every query predicts its command, and a refused command changes nothing.

Random operations against a :class:`CacheManager` (admit with prefix hits,
grow with copy-on-write after forks, preempt by recompute and by swap, swap
back in, release): before each command its query is asked, and the command
must succeed exactly when the query said yes; when it fails, nothing changed.
The integrity of device and host memory is checked after every operation,
and at the end everything is back in the pools.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.cache_manager import FULL_ATTENTION, CacheManager
from spec.errors import ArgumentTypeError, CapacityError, OutOfBlocksError, UnknownSequenceError
from spec.request import Request


def _state(c: CacheManager) -> object:
    """Tables, host blocks, pool counts (a failed allocation may count itself: not compared)."""
    m = c.manager
    return (
        {s: (m.block_table(s), m.tokens(s)) for s in m.sequence_ids()},
        {s: c.host_blocks(s) for s in c.swapped_ids()},
        c.usage(),
        c.host.num_free,
    )


def _attempt(cache: CacheManager, predicted: bool, command: object, *args: object) -> bool:
    """Run ``command``; it must succeed iff ``predicted``, and change nothing when it fails."""
    before = _state(cache)
    try:
        command(*args)  # type: ignore[operator]
    except OutOfBlocksError:
        assert not predicted, "the query said yes, the command failed"
        assert _state(cache) == before, "a refused command changed the state"
        return False
    assert predicted, "the query said no, the command succeeded"
    return True


_OPS = st.lists(
    st.tuples(
        st.sampled_from(  # admissions and releases weighted up: prefix hits on cached blocks
            ["admit"] * 4 + ["release"] * 3 + ["grow", "preempt", "swap_in", "fork", "step"]
        ),
        st.integers(0, 10**6),
        st.integers(1, 9),
        st.booleans(),
    ),
    min_size=1,
    max_size=60,
)


@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 4]),
    num_host_blocks=st.integers(0, 8),
    caching=st.booleans(),
    ops=_OPS,
)
def test_every_query_predicts_its_command(
    num_blocks: int,
    block_size: int,
    num_host_blocks: int,
    caching: bool,
    ops: list[tuple[str, int, int, bool]],
) -> None:
    cache = CacheManager(
        num_blocks, block_size, num_host_blocks=num_host_blocks, enable_prefix_caching=caching
    )
    tokens: dict[int, list[int]] = {}  # every sequence's tokens (device or host or waiting)
    next_id = 0
    for op, pick, k, flag in ops:
        m = cache.manager
        device, host = sorted(m.sequence_ids()), sorted(cache.swapped_ids())
        if op == "admit":
            prompt = [1, 2, 3, 4, 5, 6, 7, 8][: k % 8 + 1] + ([pick % 5] if flag else [])
            cached = cache.cached_tokens(prompt)
            if _attempt(cache, cache.can_admit(prompt, k), cache.admit, next_id, prompt, k):
                tokens[next_id] = prompt[: cached + min(len(prompt) - cached, k)]
            next_id += 1
        elif op == "grow" and device:
            seq = device[pick % len(device)]
            new = [pick % 7] * min(k, 3)
            if _attempt(cache, cache.can_grow(seq, len(new)), cache.grow, seq, new):
                tokens[seq] = tokens[seq] + new
        elif op == "preempt" and device:
            seq = device[pick % len(device)]
            swap = flag and cache.can_swap_out(seq)
            cache.preempt(seq, swap=swap)
            if not swap:
                del tokens[seq]  # by recompute: it would start again from waiting
        elif op == "swap_in" and host:
            seq = host[pick % len(host)]
            n = len(tokens[seq])
            tokens[seq] = tokens[seq] + [9] * (k % 3)
            num_new = k % 3
            if not _attempt(cache, cache.can_swap_in(seq, num_new), cache.swap_in, seq,
                            tokens[seq], num_new):  # fmt: skip
                tokens[seq] = tokens[seq][:n]
        elif op == "release" and (device or host):
            seq = (device + host)[pick % len(device + host)]
            cache.release(seq)
            del tokens[seq]
        elif op == "step":
            cache.layout([])  # the step's layout: pending copies are handed over
        elif op == "fork" and device:
            cache.layout([])  # a fork happens between steps
            parent = device[pick % len(device)]
            cache.fork(parent, next_id)
            tokens[next_id] = list(tokens[parent])
            next_id += 1
        cache.check_integrity()
        for seq in cache.manager.sequence_ids():
            assert list(cache.manager.tokens(seq)) == tokens[seq]
    for seq in list(cache.manager.sequence_ids()) + cache.swapped_ids():
        cache.release(seq)
    cache.layout([])
    assert cache.usage().used_blocks == 0 and cache.host.num_free == num_host_blocks


def test_admission_counts_an_evictable_prefix_hit_as_taken() -> None:
    """A hit on a cached block nobody holds takes it from the available count.

    Four blocks of 2: a finished prompt leaves 2 cached blocks, another
    sequence holds the other 2. A prompt hitting both cached blocks needs one
    fresh block more; counting only fresh blocks would say it fits (1 <= 2
    available) and the admission would fail half-way.
    """
    cache = CacheManager(4, 2, enable_prefix_caching=True)
    cache.admit(0, [1, 2, 3, 4, 5], chunk_limit=5)  # blocks 0, 1, 2
    cache.admit(1, [7], chunk_limit=1)  # block 3
    cache.layout([])
    cache.release(0)  # [1, 2] and [3, 4] stay cached; the block of [5] is free
    assert cache.usage().free_blocks == 1 and cache.usage().cached_blocks == 2
    cache.grow(1, [7, 7])  # takes the free block
    prompt = [1, 2, 3, 4, 9]
    assert cache.cached_tokens(prompt) == 4
    assert not cache.can_admit(prompt, chunk_limit=5)  # 2 evictable hits + 1 fresh > 2
    before = _state(cache)
    with pytest.raises(OutOfBlocksError):
        cache.admit(2, prompt, chunk_limit=5)
    assert _state(cache) == before
    cache.release(1)
    assert cache.can_admit(prompt, chunk_limit=5)
    assert cache.admit(2, prompt, chunk_limit=5).cached_tokens == 4


def test_admission_control_names_the_group_and_worst_case_fit_counts_samples() -> None:
    cache = CacheManager(4, 4)
    with pytest.raises(CapacityError, match=f"KV cache group '{FULL_ATTENTION}'.*pool has 4"):
        cache.check_admissible(Request(request_id=0, prompt=(1,) * 16, max_new_tokens=2))
    cache.check_admissible(Request(request_id=1, prompt=(1,) * 16, max_new_tokens=1))
    reqs = [
        Request(request_id=2, prompt=(1,) * 4, max_new_tokens=1),  # 1 block
        Request(request_id=3, prompt=(1,) * 4, max_new_tokens=2, n=2),  # 2 x 2 blocks
        Request(request_id=4, prompt=(1,), max_new_tokens=1),
    ]
    assert cache.worst_case_fit(reqs) == 1  # 1 + 4 blocks > 4
    assert cache.worst_case_fit([reqs[0], reqs[2]]) == 2 and cache.worst_case_fit(reqs[1:]) == 1


def test_bad_arguments_are_refused_by_name() -> None:
    cache = CacheManager(4, 4, num_host_blocks=2)
    with pytest.raises(ArgumentTypeError, match="tokens"):
        cache.can_admit("1234", chunk_limit=4)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="chunk_limit"):
        cache.admit(0, [1, 2], chunk_limit=2.0)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="seq_id"):
        cache.release(True)
    with pytest.raises(UnknownSequenceError):
        cache.swap_in(0, [1], num_new=0)
    cache.admit(0, [1, 2], chunk_limit=2)
    with pytest.raises(ArgumentTypeError, match="swap"):
        cache.preempt(0, swap="yes")  # type: ignore[arg-type]
    assert cache.holds(0) and cache.usage().used_blocks == 1
