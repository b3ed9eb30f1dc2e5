"""Both torch backends through the spec's Backend contract, against ReferenceBackend.

Every call is made identically on the backend under test and on the reference:
``read_cache`` must agree bit for bit (NaN for never-written slots included) and
attention within the dtype's tolerance, token by token, layer by layer. The
backends are on :data:`devices.DEVICE`, and one made without a device declares it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
from backend_helpers import (
    Scenario,
    assert_attention_close,
    fewer_examples,
    make_scenario,
    shuffled_manager,
)
from devices import DEVICE, ON_GPU
from hypothesis import given
from hypothesis import strategies as st

from backend_gpu.torch_backend import TorchBackend
from backend_gpu.triton_backend import TritonBackend
from spec.backend import Backend, ReferenceBackend
from spec.batch import build_batch
from spec.errors import InvalidRequestError, UnknownBlockError
from spec.kv_geometry import KVGeometry

FEW = fewer_examples(6, minimum=3)

BACKENDS: dict[str, Callable[[], Backend]] = {
    "triton": lambda: TritonBackend(DEVICE),
    "triton-split": lambda: TritonBackend(DEVICE, num_splits=3),
    "torch": lambda: TorchBackend(DEVICE),
}


@pytest.fixture(params=list(BACKENDS))
def make_backend(request: pytest.FixtureRequest) -> Callable[[], Backend]:
    return BACKENDS[request.param]


def _run_step(backend: Backend, s: Scenario, pad_rows: int = 2) -> list[np.ndarray]:
    """Write earlier context, then this step's tokens (padded rows, a -1 slot), then attend."""
    geometry = KVGeometry(*s.geometry_args, dtype=s.dtype)
    backend.create_cache(geometry)
    for layer, k, v, slots in s.context_writes:
        backend.write_kv(layer, k.astype(np.float32), v.astype(np.float32), slots)
    outs = []
    slots = [*s.batch.slot_mapping, -1]
    for layer in range(geometry.num_layers):
        pad = np.full((1 + pad_rows, *s.keys[layer].shape[1:]), 1e6)
        k = np.concatenate([s.keys[layer], pad]).astype(np.float32)
        v = np.concatenate([s.values[layer], pad]).astype(np.float32)
        backend.write_kv(layer, k, v, slots)
        outs.append(backend.attention(layer, s.queries[layer].astype(np.float32), s.batch, 0.3))
    return outs


def _check_against_reference(backend: Backend, s: Scenario) -> None:
    outs = _run_step(backend, s)
    ref = ReferenceBackend()
    ref_outs = _run_step(ref, s)
    name = backend.capabilities.name
    for layer, (got, want) in enumerate(zip(outs, ref_outs, strict=True)):
        assert got.dtype in (np.float32, np.float64)
        assert_attention_close(got, want, s.dtype, s.batch, layer, f"{name} attention")
        for kind, g, w in zip("KV", backend.read_cache(layer), ref.read_cache(layer), strict=True):
            same = np.array_equal(g.astype(np.float64), w, equal_nan=True)
            assert same, f"{name}: {kind} cache of layer {layer} differs from the reference"


def test_backends_satisfy_the_protocol_and_declare_their_device(
    make_backend: Callable[[], Backend],
) -> None:
    backend = make_backend()
    assert isinstance(backend, Backend)
    caps = backend.capabilities
    assert caps.device == str(DEVICE) and caps.name in ("triton", "torch")
    assert caps.unsupported(KVGeometry(1, 4, 3, 2, 24, dtype="bfloat16"), num_heads=16) == []
    with pytest.raises(InvalidRequestError, match="create_cache"):
        backend.read_cache(0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_mixed_batch_two_layers_every_dtype(
    make_backend: Callable[[], Backend], dtype: str
) -> None:
    work = [(16, 1), (0, 7), (5, 4), (33, 1)]
    s = make_scenario(
        3, work, block_size=16, num_kv_heads=2, group=4, head_dim=24, dtype=dtype, num_layers=2
    )
    _check_against_reference(make_backend(), s)


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@FEW
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    block_size=st.sampled_from([1, 3, 16]),
    group=st.sampled_from([1, 2, 4, 8]),
    work=st.lists(st.tuples(st.integers(0, 35), st.integers(1, 9)), min_size=1, max_size=4),
)
def test_random_steps_match_the_reference(
    backend_name: str,
    seed: int,
    dtype: str,
    block_size: int,
    group: int,
    work: list[tuple[int, int]],
) -> None:
    s = make_scenario(
        seed, work, block_size=block_size, num_kv_heads=1, group=group, head_dim=24, dtype=dtype
    )
    _check_against_reference(BACKENDS[backend_name](), s)


def test_copy_on_write_beams_match_the_reference(make_backend: Callable[[], Backend]) -> None:
    """A prompt forked into beams; each beam's first token copies the shared last block."""
    backend, ref = make_backend(), ReferenceBackend()
    block_size, heads, dim = 3, 1, 8
    m = shuffled_manager(12, block_size, seed=4)
    geometry = KVGeometry(2, 12, block_size, heads, dim)
    rng = np.random.default_rng(4)
    for b in (backend, ref):
        b.create_cache(geometry)
    m.add_sequence(0, [1] * 5)
    prompt_slots = m.append_slots(0, [1] * 5)
    kv = rng.standard_normal((5, heads, dim)).astype(np.float32)
    for b in (backend, ref):
        for layer in range(2):
            b.write_kv(layer, kv, -kv, prompt_slots)
    assert m.take_copies() == []  # the prompt's step is done: now the beams may fork
    for child in (1, 2):
        m.fork(0, child)
    for seq in (0, 1, 2):
        m.append_slots(seq, [seq + 2])
    batch = build_batch(m, [(0, 1), (1, 1), (2, 1)])
    assert len(batch.copies) == 2
    new = rng.standard_normal((3, heads, dim)).astype(np.float32)
    query = rng.standard_normal((3, 2, dim)).astype(np.float32)
    for b in (backend, ref):
        b.copy_blocks(batch.copies)
        for layer in range(2):
            b.write_kv(layer, new, new, batch.slot_mapping)
    for layer in range(2):
        for g, w in zip(backend.read_cache(layer), ref.read_cache(layer), strict=True):
            assert np.array_equal(g, w, equal_nan=True), f"cache of layer {layer} after copies"
        got = backend.attention(layer, query, batch, 0.5)
        want = ref.attention(layer, query, batch, 0.5).astype(np.float64)
        assert_attention_close(got, want, "float32", batch, layer, "attention after CoW")


def test_bad_calls_raise_and_leave_the_cache_alone(make_backend: Callable[[], Backend]) -> None:
    backend = make_backend()
    backend.create_cache(KVGeometry(2, 4, 2, 1, 8))
    before = backend.read_cache(0)
    kv = np.ones((1, 1, 8), dtype=np.float32)
    with pytest.raises(InvalidRequestError, match="slot 8 is outside"):
        backend.write_kv(0, kv, kv, [8])
    with pytest.raises(InvalidRequestError, match="layer 2"):
        backend.write_kv(2, kv, kv, [0])
    with pytest.raises(InvalidRequestError, match="key has shape"):
        backend.write_kv(0, np.ones((1, 2, 8)), kv, [0])
    with pytest.raises(UnknownBlockError):
        backend.copy_blocks([(0, 4)])
    for g, w in zip(backend.read_cache(0), before, strict=True):
        assert np.array_equal(g, w, equal_nan=True)


def test_attention_rejects_a_batch_laid_out_for_another_block_size(
    make_backend: Callable[[], Backend],
) -> None:
    s = make_scenario(2, [(3, 2)], block_size=4, num_kv_heads=1, group=2, head_dim=8)
    backend = make_backend()
    backend.create_cache(KVGeometry(1, s.memory.shape[0], 2, 1, 8))
    with pytest.raises(InvalidRequestError, match="block size 4"):
        backend.attention(0, s.queries[0], s.batch, 0.3)
    with pytest.raises(InvalidRequestError):
        backend.attention(0, s.queries[0][:, :1, :4], s.batch, 0.3)


@pytest.mark.parametrize("make", [TritonBackend, TorchBackend], ids=["triton", "torch"])
def test_a_backend_made_without_a_device_declares_the_machines(make: Callable[[], Backend]) -> None:
    """The GPU where kernels compile for one; the CPU under the interpreter (which hides a GPU
    from ``make test``'s session, see tests/conftest.py)."""
    assert make().capabilities.device == DEVICE.type


def test_importing_backend_gpu_turns_on_the_interpreter_only_without_cuda() -> None:
    """In a child that has not chosen: interpreted without CUDA, left to compile with it (the
    child sees a GPU exactly when this session does)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch, os, backend_gpu; "
        "print(torch.cuda.is_available(), os.environ.get('TRITON_INTERPRET'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == (["True", "None"] if ON_GPU else ["False", "1"])
