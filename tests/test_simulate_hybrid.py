"""The simulator serves the hybrid 27B: its clock pays for the state, its memory runs
through a full-attention group and a state group, one slot per seat."""

from __future__ import annotations

import pytest

from paged_spec.sim.cost import GPU_PRESETS, MODEL_PRESETS, step_seconds
from paged_spec.sim.run import POLICIES, run
from paged_spec.sim.traffic import TraceRequest
from paged_spec.simulate import SimConfig, main
from spec.kv_budget import MIB

HYBRID = SimConfig(model="hybrid-27b", kv_pool_gib=4.0, max_num_seqs=6, max_model_len=1024)


def test_every_policy_serves_a_hybrid_trace() -> None:
    trace = [TraceRequest(0.01 * i, 20 + 37 * i % 300, 5 + 11 * i % 60) for i in range(16)]
    engine = HYBRID.engine()
    assert engine.pool_tokens == (4 * 1024 - 6 * 144) * MIB // (64 * 1024)  # state slots first
    for policy in POLICIES:
        m, tl = run(policy, trace, engine)
        assert m["output_tokens"] == sum(r.output_len for r in trace), policy
        assert max(tl.running) <= 6, policy  # a seat, a state slot: never more sequences
    sched = engine.scheduler("paged")
    assert [g.name for g in sched.cache.groups] == ["full attention", "fixed-size state"]  # type: ignore[attr-defined]


def test_the_state_costs_a_read_and_a_write_a_step() -> None:
    gpu, model = GPU_PRESETS["h200"], MODEL_PRESETS["hybrid-27b"]
    one, two = (step_seconds(gpu, model, [(1, 100)] * n) for n in (1, 2))
    per_sequence = 2 * model.state_bytes + 101 * model.kv_bytes_per_token
    assert two - one == pytest.approx(per_sequence / gpu.hbm_bytes_per_s)


def test_too_many_seats_for_the_state_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--model", "hybrid-27b", "--kv-pool-gib", "4", "--num-requests", "4"])
    assert code == 2
    assert "512 state slots" in capsys.readouterr().err
