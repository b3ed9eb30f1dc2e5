"""The continuous scheduler over a hybrid model's KV cache groups.

Random workloads (prompts sharing prefixes, parallel samples, preemption by
recompute and by swap, prefix caching on and off) run to completion over a
full-attention group, a sliding-window group and a fixed-size state group.
After every step the memory side's invariants hold, every running sequence
holds exactly one state slot, and each windowed sequence holds no more than
its window and its step's chunk need; at the end every block and slot is
back. Admission control names the group that can never take a request.
"""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.cache_manager import FIXED_STATE, FULL_ATTENTION, CacheManager, sliding_window
from spec.errors import ArgumentTypeError, ArgumentValueError, CapacityError
from spec.kv_budget import cdiv
from spec.request import Request
from spec.scheduler import ContinuousScheduler, SchedulerConfig

HYBRID = (FULL_ATTENTION, sliding_window(6), FIXED_STATE)


def _requests(seed: int, count: int) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
    return [
        Request(
            request_id=i,
            prompt=tuple(shared + [rng.randrange(3) for _ in range(rng.randint(1, 10))]),
            max_new_tokens=rng.randint(1, 12),
            n=rng.choice([1, 1, 2]),
        )
        for i in range(count)
    ]


@given(
    seed=st.integers(0, 10**6),
    num_blocks=st.integers(18, 44),
    preemption=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    state=st.booleans(),
    window=st.integers(1, 9),
)
def test_groups_through_a_workload(
    seed: int, num_blocks: int, preemption: str, caching: bool, state: bool, window: int
) -> None:
    groups = (FULL_ATTENTION, sliding_window(window)) + ((FIXED_STATE,) if state else ())
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=2,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        max_model_len=64,
        preemption=preemption,  # type: ignore[arg-type]
        num_host_blocks=24,
        enable_prefix_caching=caching,
        kv_groups=groups,
        num_host_state_slots=4 if state else 0,
    )
    sched = ContinuousScheduler(config)
    rng = random.Random(seed)
    pending = _requests(seed, 8)
    cache = sched.cache
    while pending or sched.has_unfinished():
        while pending and rng.random() < 0.5:
            with contextlib.suppress(CapacityError):  # could never fit: refused at submission
                sched.submit(pending.pop())
        out = sched.step()
        windowed = cache.managers[1]
        for seq_id, q in out.scheduled:
            held = len(windowed.held_blocks(seq_id))
            assert held <= cdiv(window + q - 2, 2) + 1, f"{seq_id} holds {held} for {q} tokens"
        if state:
            assert cache.state is not None and out.batch.state is not None
            assert len(out.batch.state.slots) == out.batch.num_seqs
        sched.update({s.seq_id: rng.randrange(3) for s in out.samples})
        sched.check_integrity()
    cache.layout([])
    assert cache.pool.num_held == 0 and cache.host.num_free == 24
    if cache.state is not None:
        assert cache.state.pool.num_free == cache.state.pool.num_slots


def test_a_windowed_group_keeps_prefix_hits_after_releasing_them() -> None:
    """Released blocks stay cached: a second request with the same prompt hits in every group."""
    cache = CacheManager(
        32, 4, enable_prefix_caching=True, groups=(FULL_ATTENTION, sliding_window(4))
    )
    prompt, window = list(range(20)), cache.managers[1]
    cache.admit(0, prompt, chunk_limit=20)
    cache.layout([(0, 20)])
    last_prompt_block = window.block_table(0)[4]  # positions 16..19
    for t in range(20, 28):  # decode past the prompt: the window releases the prompt's blocks
        cache.grow(0, [t])
        cache.layout([(0, 1)])
    assert window.block_table(0)[:6] == (-1,) * 6
    assert cache.cached_tokens([*prompt, 99]) == 20
    assert cache.admit(1, [*prompt, 99], chunk_limit=4).cached_tokens == 20
    table = window.block_table(1)  # the query at 20 sees 17..20: only block 4 is needed
    assert table[:4] == (-1,) * 4 and table[4] == last_prompt_block
    cache.check_integrity()


def test_a_state_group_supplies_no_prefix() -> None:
    cache = CacheManager(32, 4, enable_prefix_caching=True, groups=HYBRID, num_state_slots=2)
    cache.admit(0, list(range(12)), chunk_limit=12)
    cache.layout([(0, 12)])
    assert cache.managers[0].cached_prefix([*range(12), 1]) == 12  # the KV is there
    assert cache.cached_tokens([*range(12), 1]) == 0  # but not the state after it


def test_admission_control_names_the_group() -> None:
    request = Request(request_id=7, prompt=tuple(range(30)), max_new_tokens=3)  # 32 KV tokens
    full_only = CacheManager(7, 4, groups=(FULL_ATTENTION, sliding_window(4)), max_chunk_tokens=4)
    with pytest.raises(CapacityError, match=r"group 'full attention': 32 tokens .* 8 blocks of 4"):
        full_only.check_admissible(request)
    shared = CacheManager(10, 4, groups=(FULL_ATTENTION, sliding_window(4)), max_chunk_tokens=4)
    each = r"\('full attention' 8, 'sliding window 4' 3\)"
    with pytest.raises(CapacityError, match=rf"need 11 blocks .*{each}, but the pool they share"):
        shared.check_admissible(request)
    CacheManager(
        11, 4, groups=(FULL_ATTENTION, sliding_window(4)), max_chunk_tokens=4
    ).check_admissible(request)  # 8 + 3 blocks: fits
    state = CacheManager(16, 4, groups=HYBRID, num_state_slots=1)
    with pytest.raises(CapacityError, match="group 'fixed-size state': 2 samples need 2 state"):
        state.check_admissible(Request(request_id=8, prompt=(1,), max_new_tokens=1, n=2))


def test_scheduler_config_checks_the_groups() -> None:
    with pytest.raises(ArgumentValueError, match="num_state_slots must be >= max_num_seqs"):
        SchedulerConfig(num_blocks=8, block_size=4, kv_groups=HYBRID, num_state_slots=3)
    with pytest.raises(ArgumentValueError, match="num_state_slots is only for"):
        SchedulerConfig(num_blocks=8, block_size=4, num_state_slots=3)
    with pytest.raises(ArgumentTypeError, match=r"kv_groups\[0\] must be"):
        SchedulerConfig(num_blocks=8, block_size=4, kv_groups=("full",))  # type: ignore[arg-type]
    with pytest.raises(ArgumentValueError, match="one fixed-size state group"):
        CacheManager(8, 4, groups=(FULL_ATTENTION, FIXED_STATE, FIXED_STATE))
    assert SchedulerConfig(num_blocks=8, block_size=4, kv_groups=HYBRID).num_state_slots == 16
