"""The engine with speculative decoding: exactly plain decoding's output, fewer steps."""

from __future__ import annotations

import pytest

from paged_spec.engine.loop import Engine
from paged_spec.engine.speculative import (
    LayerSkipDrafter,
    SpeculativeEngine,
    ngram_drafter,
    ngram_drafts,
)
from paged_spec.engine.tiny_model import TinyModel, generate_alone
from paged_spec.engine_demo import make_requests
from spec.backend import ReferenceBackend
from spec.scheduler import ContinuousScheduler, SchedulerConfig


def _config(k: int) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=40,
        block_size=8,
        max_num_batched_tokens=32,
        max_num_seqs=6,
        max_model_len=512,
        enable_prefix_caching=True,
        num_speculative_tokens=k,
    )


@pytest.mark.parametrize("draft", ["layers", "ngram"])
def test_speculative_output_is_plain_decoding_token_for_token(draft: str) -> None:
    model = TinyModel()
    requests, arrivals = make_requests(4, seed=3)
    drafter = LayerSkipDrafter(model) if draft == "layers" else ngram_drafter
    spec = SpeculativeEngine(model, ReferenceBackend(), ContinuousScheduler(_config(3)), drafter)
    spec.run(requests, arrivals)
    plain = Engine(model, ReferenceBackend(), ContinuousScheduler(_config(0)))
    plain.run(requests, arrivals)
    for r in requests:
        alone = tuple(generate_alone(model, r, i) for i in range(r.n))
        assert spec.finished[r.request_id].outputs == plain.finished[r.request_id].outputs == alone
    totals = spec.scheduler.metrics.totals()
    if draft == "layers":  # the first layer often agrees with both
        assert totals["draft_tokens"] > 0 and totals["accepted_tokens"] > 0
        assert len(spec.step_end_times) < len(plain.step_end_times)
    spec.scheduler.manager.check_integrity()
    assert spec.scheduler.manager.pool.num_held == 0


def test_ngram_drafts_propose_what_followed_the_longest_earlier_suffix() -> None:
    assert ngram_drafts([1, 2, 3, 1, 2], 2) == [3, 1]
    assert ngram_drafts([4, 1, 2, 9, 7, 2], 3) == [9, 7, 2]  # "2" alone: its latest earlier place
    assert ngram_drafts([1, 2, 3, 1, 2], 0) == []
    assert ngram_drafts([5], 4) == []
