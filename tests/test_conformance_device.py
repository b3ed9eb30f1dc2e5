"""The device-resident contract (``tensors="torch"``): conformance, planted bugs, bad returns.

The suite builds each step's metadata once on the backend's device, hands
tensors in, passes the step's new K and V to attention, reads back only the
blocks it compares, and checks the kind, device, dtype and shape of whatever
comes back. The numpy contract (the default) is unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from backend_gpu.torch_backend import TorchBackend, make_device_backend
from conformance.errors import SetupError
from conformance.judges.device_contract import DeviceContract, setup_problem
from conformance.lockstep.driver import ConformanceFailure, Lockstep
from conformance.lockstep.workload import WorkloadConfig
from conformance.run.discovery import load_backend
from conformance.run.runner import run_suite
from conformance.testing import BackendConformance
from paged_spec.engine_demo import make_backend as engine_backend
from spec.attention import AttentionVariant
from spec.backend import Backend, FloatArray, ReferenceBackend
from spec.batch import BatchArrays, BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "tests/device_backend/device_backend.py"


def _example(factory: str = "make_backend") -> Any:
    """The example device backend, loaded as the suite loads it (an outside project's file)."""
    return load_backend(f"{ROOT / EXAMPLE}:{factory}")


def _as_backend(backend: object) -> Backend:
    """A device-contract backend as the Protocol's type (its annotations spell numpy)."""
    return cast(Backend, backend)


class _Wrapped:
    """Another backend, with the methods a test overrides; everything else is the inner one's."""

    def __init__(self, inner: Any | None = None) -> None:
        self.inner = _example() if inner is None else inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _run(backend: object, ref: str, *, shrink: bool = True) -> Any:
    """Six short examples of the suite, as ``python -m conformance run`` runs them."""
    return run_suite(
        cast(Backend, backend),
        ref,
        run_seed=3,
        database=None,
        max_examples=6,
        passes=("short",),
        shrink=shrink,
    )


def _config(**geometry: Any) -> WorkloadConfig:
    g = {"num_layers": 2, "num_blocks": 12, "block_size": 4, "num_kv_heads": 1, "head_dim": 8}
    return WorkloadConfig(KVGeometry(**{**g, **geometry}), num_heads=2, scale=0.35, seed=1)


def _drive(ls: Lockstep) -> None:
    """A prefill, a decode, a fork and a step of both: every kind of call the suite makes."""
    ls.add(0, [7, 8, 9, 10, 11])
    ls.step([(0, [7, 8, 9, 10, 11])])
    ls.step([(0, [1])])
    ls.fork(0, 1)
    ls.step([(0, [2]), (1, [3])])
    ls.finish()


# -- conformance through the device path ---------------------------------------------


def test_the_torch_backend_conforms_through_the_device_contract() -> None:
    result = _run(make_device_backend("cpu"), "backend_gpu.torch_backend:make_device_backend")
    assert result.passed, result.difference
    assert result.stats.checks["attention outputs judged against the same-precision reference"]


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_the_torch_backend_runs_fp8_and_a_variant_through_the_device_contract(
    kv_dtype: str,
) -> None:
    config = replace(
        _config(dtype="bfloat16", kv_dtype=kv_dtype, kv_scales=((0.5, 0.25), (1.0, 2.0))),
        variants=(AttentionVariant(window=3), AttentionVariant(softcap=5.0)),
    )
    ls = Lockstep(make_device_backend("cpu"), config)
    _drive(ls)
    assert ls.checks["attention outputs judged against the same-precision reference"]


def test_the_triton_backend_serves_the_device_contract() -> None:
    """On the device its kernels run on: the CPU interpreted, the GPU compiled."""
    from devices import DEVICE

    from backend_gpu.triton_backend import make_device_backend as triton_device

    backend = triton_device(DEVICE)
    assert backend.capabilities.tensors == "torch"
    ls = Lockstep(backend, _config(dtype="float16"))
    _drive(ls)
    assert ls.checks["attention outputs judged against the same-precision reference"]


def test_the_example_device_backend_conforms() -> None:
    result = _run(_example(), f"{EXAMPLE}:make_backend")
    assert result.passed, result.difference


def test_a_planted_off_by_one_mask_is_caught_through_the_device_path() -> None:
    result = _run(_example("make_buggy_backend"), f"{EXAMPLE}:make_buggy_backend", shrink=False)
    assert not result.passed
    assert result.difference is not None and result.difference.what == "output"


def test_the_pytest_way_writes_and_reads_in_the_device_contract() -> None:
    BackendConformance().test_write_then_read_returns_the_values_exactly(_example())


# -- what the suite hands over ---------------------------------------------------------


class _Recording(_Wrapped):
    """The example backend, noting what each call was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, Any]] = []
        self.reads: Counter[str] = Counter()

    def write_kv(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        self.seen.append(("write_kv", (key, value, slot_mapping)))
        self.inner.write_kv(layer, key, value, slot_mapping)

    def attention(
        self,
        layer: int,
        query: torch.Tensor,
        batch: BatchMetadata,
        scale: float,
        *,
        arrays: BatchArrays[torch.Tensor],
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        self.seen.append(("attention", (query, batch, arrays, key, value)))
        out: torch.Tensor = self.inner.attention(
            layer, query, batch, scale, arrays=arrays, key=key, value=value
        )
        return out

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads["read_blocks"] += 1
        self.reads["blocks"] += len(blocks)
        out: tuple[torch.Tensor, torch.Tensor] = self.inner.read_blocks(layer, blocks)
        return out

    def read_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads["read_cache"] += 1
        out: tuple[torch.Tensor, torch.Tensor] = self.inner.read_cache(layer)
        return out


def test_metadata_is_built_once_per_step_and_shared_by_every_layer() -> None:
    backend = _Recording()
    ls = Lockstep(_as_backend(backend), _config(dtype="float16"))
    ls.add(0, [7, 8, 9, 10, 11])
    ls.step([(0, [7, 8, 9, 10, 11])])
    calls = [args for what, args in backend.seen if what == "attention"]
    assert len(calls) == 2  # one per layer
    (q0, batch, arrays, k0, v0), (_, _, arrays1, _, _) = calls
    assert arrays1 is arrays  # the same device tensors for both layers
    assert arrays.block_tables.dtype == torch.int32 and arrays.seq_lens.dtype == torch.int32
    assert arrays.slot_mapping.dtype == torch.int64 and arrays.positions.dtype == torch.int64
    assert arrays.block_tables.tolist() == [list(batch.block_tables[0])]
    assert q0.dtype == k0.dtype == v0.dtype == torch.float16 and q0.device.type == "cpu"
    assert k0.shape == (5, 1, 8) and q0.shape == (5, 2, 8)
    writes = [args for what, args in backend.seen if what == "write_kv"][-2:]
    assert writes[0][2] is writes[1][2]  # the step's slot mapping, built once
    assert writes[0][2].dtype == torch.int64


def test_attention_gets_the_step_new_kv_exactly_as_written() -> None:
    backend = _Recording()
    ls = Lockstep(_as_backend(backend), _config())
    ls.add(0, [7, 8, 9])
    ls.step([(0, [7, 8, 9])])
    (_, (key, value, slots)), (_, (_, _, _, new_k, new_v)) = backend.seen[-2:]
    assert len(new_k) == 3 and torch.equal(new_k, key[:3]) and torch.equal(new_v, value[:3])
    cached = backend.k[1].view(-1, 1, 8)[slots[:3]]
    assert torch.equal(new_k, cached), "the new K handed to attention is what the cache holds"


def test_only_the_compared_blocks_are_read_back() -> None:
    backend = _Recording()
    ls = Lockstep(_as_backend(backend), _config(num_blocks=64))
    ls.add(0, [7, 8, 9])
    before = backend.reads.copy()
    ls.step([(0, [7, 8, 9])])  # one block written: it and its neighbour, per layer
    assert backend.reads["read_cache"] == 0
    assert backend.reads["blocks"] - before["blocks"] == 2 * 2


def test_the_numpy_contract_is_unchanged() -> None:
    seen: list[tuple[str, tuple[object, ...], dict[str, object]]] = []

    class Numpy(ReferenceBackend):
        def write_kv(
            self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
        ) -> None:
            seen.append(("write_kv", (key, value, slot_mapping), {}))
            super().write_kv(layer, key, value, slot_mapping)

        def attention(
            self, layer: int, query: FloatArray, batch: BatchMetadata, scale: float, **kw: Any
        ) -> FloatArray:
            seen.append(("attention", (query,), kw))
            return super().attention(layer, query, batch, scale, **kw)

    _drive(Lockstep(Numpy(), _config()))
    for what, args, kwargs in seen:
        assert kwargs == {}, f"{what} got {sorted(kwargs)}"
        assert all(isinstance(a, np.ndarray) for a in args[:2]), what
        if what == "write_kv":
            assert isinstance(args[2], list)


def test_the_numpy_torch_backend_is_unchanged_and_declares_numpy() -> None:
    backend = TorchBackend("cpu")
    assert backend.capabilities.tensors == "numpy"
    _drive(Lockstep(backend, _config()))


# -- bad returns and bad inputs, named ---------------------------------------------------


class _Returns(_Wrapped):
    """The example backend with one thing wrong in what it returns or does."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def attention(self, layer: int, query: torch.Tensor, *args: Any, **kw: Any) -> Any:
        if self.fault == "mutate query":
            query.mul_(1)
        if self.fault == "mutate tables":
            kw["arrays"].block_tables.add_(0)
        out = self.inner.attention(layer, query, *args, **kw)
        return {
            "numpy": out.numpy(),
            "dtype": out.float(),
            "device": out.to("meta"),
            "shape": out[:, :1],
        }.get(self.fault, out)

    def read_blocks(self, layer: int, blocks: Sequence[int]) -> Any:
        k, v = self.inner.read_blocks(layer, blocks)
        return {"read dtype": (k.double(), v), "read one": k}.get(self.fault, (k, v))


@pytest.mark.parametrize(
    ("fault", "kind", "says"),
    [
        (
            "numpy",
            "shape",
            "attention returned a numpy ndarray; the device contract returns a torch",
        ),
        ("dtype", "shape", "attention returned torch.float32, expected torch.float16"),
        (
            "device",
            "shape",
            "attention returned a tensor on meta, expected the backend's device cpu",
        ),
        ("shape", "shape", "attention returned shape (5, 1, 8), expected (5, 2, 8)"),
        (
            "read dtype",
            "shape",
            "read_blocks(0, ...) K returned torch.float64, expected torch.float16",
        ),
        (
            "read one",
            "shape",
            "read_blocks(0, ...) returned a Tensor; the device contract returns a",
        ),
        ("mutate query", "input", "backend.attention changed its input `query` in place"),
        ("mutate tables", "input", "changed its input `arrays.block_tables` in place"),
    ],
)
def test_a_bad_return_or_input_change_is_a_failure_naming_it(
    fault: str, kind: str, says: str
) -> None:
    with pytest.raises(ConformanceFailure) as info:
        _drive(Lockstep(_as_backend(_Returns(fault)), _config(dtype="float16")))
    diff = info.value.difference
    assert diff.what == kind and says in diff.detail, diff.detail


def test_setup_problems_are_named() -> None:
    class NoReads(_Wrapped):
        read_blocks = None

    caps = _example().capabilities
    assert "needs read_blocks(layer, blocks)" in str(setup_problem(NoReads(), caps))
    odd = Capabilities("x", device="nosuchdevice", tensors="torch")
    assert "on device 'nosuchdevice', which torch cannot use" in str(setup_problem(_example(), odd))
    assert setup_problem(ReferenceBackend(), ReferenceBackend().capabilities) is None
    with pytest.raises(ValueError, match="needs read_blocks"):
        Lockstep(_as_backend(NoReads()), _config())


def test_the_suites_loader_refuses_a_device_backend_it_cannot_run(tmp_path: Path) -> None:
    path = tmp_path / "no_reads.py"
    path.write_text(
        "from spec.backend import Capabilities\n"
        "class NoReads:\n"
        "    capabilities = Capabilities('no-reads', tensors='torch')\n"
        "    def create_cache(self, g): pass\n"
        "    def write_kv(self, *a): pass\n"
        "    def copy_blocks(self, c): pass\n"
        "    def attention(self, *a, **k): pass\n"
        "    def read_cache(self, layer): pass\n"
    )
    with pytest.raises(SetupError, match="needs read_blocks"):
        load_backend(f"{path}:NoReads")


def test_the_engine_refuses_the_device_contract_by_name() -> None:
    with pytest.raises(SetupError, match="declares tensors='torch': the engine drives the numpy"):
        engine_backend("backend_gpu.torch_backend:make_device_backend")


def test_the_contract_converter_keeps_values_exact() -> None:
    dc = DeviceContract(Capabilities("x", tensors="torch"), KVGeometry(1, 2, 2, 1, 4, "bfloat16"))
    x = np.array([[[1.0, 1.0078125, -3.5, 2.0**-10]]])  # bfloat16 values
    t = dc.activations(x)
    assert t.dtype == torch.bfloat16
    assert np.array_equal(dc.output("attention", t, x.shape), x)
