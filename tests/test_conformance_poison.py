"""Poisoned memory: every slot no live token owns holds NaN or an infinity, on both sides."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from backend_gpu.torch_backend import TorchBackend
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.numpy_backend import NumpyPagedBackend
from conformance.lockstep.workload import (
    NON_FINITE,
    POISONS,
    WorkloadConfig,
    geometry_for,
    scale_for,
)
from conformance.planted.backends import MasksByZeroWeight
from spec.backend import Backend, ReferenceBackend


def _config(poison: str | None, prefix_caching: bool = True) -> WorkloadConfig:
    geometry, heads = geometry_for(4, 2, 2, 8, "float16", 1)
    return WorkloadConfig(
        geometry, heads, scale_for(8, False), 5, prefix_caching=prefix_caching, poison=poison
    )


def _workload(ls: Lockstep) -> None:
    """Partial blocks, a free, a prefix hit on a freed (cached) block, then decodes."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    ls.add(0, prompt)
    ls.step([(0, prompt)])
    ls.add(1, [4, 4, 4])
    ls.step([(0, [3]), (1, [4, 4, 4])])
    ls.free(0)
    hit = ls.add(2, [*prompt[:8], 11])
    assert hit == 8
    ls.step([(2, [11]), (1, [5])])
    ls.step([(2, [12])])
    ls.finish()


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("backend", [ReferenceBackend, NumpyPagedBackend, TorchBackend])
def test_correct_backends_pass_with_poisoned_memory(poison: str, backend: type[Backend]) -> None:
    ls = Lockstep(backend(), _config(poison))
    _workload(ls)
    assert ls.checks["slots no live token owns poisoned"] > 0


@pytest.mark.parametrize("poison", NON_FINITE)
def test_a_kernel_that_multiplies_unowned_slots_by_zero_fails_and_is_told_why(
    poison: str,
) -> None:
    _workload(Lockstep(MasksByZeroWeight(), _config(None)))  # exact on finite memory
    _workload(Lockstep(MasksByZeroWeight(), _config("finite")))  # and on finite poison
    with pytest.raises(ConformanceFailure) as caught:
        _workload(Lockstep(MasksByZeroWeight(), _config(poison)))
    first = caught.value.difference.describe().splitlines()[0]
    assert "the output is not finite where the reference is" in first
    assert f"slots no token owns hold {poison}" in first


def test_the_prefix_cache_keeps_its_blocks_and_only_unowned_slots_are_poisoned() -> None:
    ls = Lockstep(NumpyPagedBackend(), _config("NaN"))
    _workload(ls)
    k, _ = ls.memory.read_blocks(0, list(range(ls.config.geometry.num_blocks)))
    flat = k.reshape(-1, k.shape[2] * k.shape[3])
    owned = ls._owners()
    nan_rows = {int(s) for s in np.flatnonzero(np.isnan(flat).all(axis=1))}
    assert not nan_rows & set(owned)
    assert len(nan_rows) + len(owned) <= flat.shape[0]


def test_poison_must_be_known() -> None:
    with pytest.raises(ValueError, match="poison must be one of"):
        replace(_config(None), poison="zero")
