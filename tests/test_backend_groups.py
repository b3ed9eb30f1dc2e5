"""The torch and Triton backends run a model whose layers sit in two KV cache groups.

Steps laid out by the spec's memory side over two groups (one shared block
pool, so the groups' tables name different blocks), layer 0 in group 0 and
layer 1 in group 1: each layer writes through its group's slots and reads
through its group's tables. A backend that read group 0's tables for layer 1
would read blocks that layer never wrote. With a sliding-window group the
windowed layer's table has a released prefix (``-1`` entries) that the
backend must never read; that needs the window variant.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from spec.attention import AttentionVariant
from spec.backend import Backend, ReferenceBackend
from spec.cache_manager import FULL_ATTENTION, CacheManager, sliding_window
from spec.kv_geometry import KVGeometry
from spec.kv_groups import KVCacheGroup


def _torch() -> Backend:
    from devices import DEVICE

    from backend_gpu.torch_backend import TorchBackend

    return TorchBackend(DEVICE)


def _triton() -> Backend:
    from devices import DEVICE

    from backend_gpu.triton_backend import TritonBackend

    return TritonBackend(DEVICE)


BACKENDS: dict[str, Callable[[], Backend]] = {"torch": _torch, "triton": _triton}
B, HEADS, KV_HEADS, DIM = 2, 4, 2, 8


def _run(
    backend: Backend, groups: tuple[KVCacheGroup, ...], window: int | None
) -> list[np.ndarray]:
    """Prefill two sequences, decode five steps; every step's attention output of both layers."""
    cache = CacheManager(40, B, groups=groups)
    geometry = KVGeometry(2, 40, B, KV_HEADS, DIM, layer_groups=(0, 1))
    backend.create_cache(geometry)
    variants = [None, None if window is None else AttentionVariant(window=window)]
    rng = np.random.default_rng(0)
    tokens = {0: list(range(9)), 1: list(range(5))}
    for seq, prompt in tokens.items():
        cache.admit(seq, prompt, chunk_limit=len(prompt))
    rows = [(0, 9), (1, 5)]
    outputs = []
    for _ in range(6):
        batch = cache.layout(rows)
        if batch.copies:
            backend.copy_blocks(batch.copies)
        t = batch.num_tokens
        for layer in range(2):
            kv = rng.standard_normal((2, t, KV_HEADS, DIM)).astype(np.float32)
            q = rng.standard_normal((t, HEADS, DIM)).astype(np.float32)
            backend.write_kv(layer, kv[0], kv[1], batch.slots(geometry.group_of(layer)))
            kw = {} if variants[layer] is None else {"variant": variants[layer]}
            outputs.append(np.asarray(backend.attention(layer, q, batch, 0.5, **kw)))
        for seq in tokens:
            cache.grow(seq, [1])
        rows = [(0, 1), (1, 1)]
    assert window is None or -1 in batch.tables(1)[0], "the windowed group released nothing"
    return outputs


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_two_full_attention_groups_match_the_reference(name: str) -> None:
    backend = BACKENDS[name]()
    assert backend.capabilities.kv_groups
    groups = (FULL_ATTENTION, FULL_ATTENTION)
    for got, want in zip(
        _run(backend, groups, None), _run(ReferenceBackend(), groups, None), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_windowed_group_with_a_released_prefix_matches_the_reference(name: str) -> None:
    backend = BACKENDS[name]()
    if "window" not in backend.capabilities.variants:
        pytest.skip(f"{name} does not declare the window variant (needed to skip released blocks)")
    groups = (FULL_ATTENTION, sliding_window(3))
    for got, want in zip(
        _run(backend, groups, 3), _run(ReferenceBackend(), groups, 3), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_the_reference_reads_only_the_window() -> None:
    """The windowed layer's outputs equal the reference's own run (it never reads a -1 entry)."""
    outputs = _run(ReferenceBackend(), (FULL_ATTENTION, sliding_window(3)), 3)
    assert all(np.isfinite(o).all() for o in outputs)
