"""vLLM's Triton unified attention adapter, checked by hand against a float64 reference.

Every case goes through :mod:`conformance.adapters.vllm_unified` as the suite
drives it (the KV write kernel, then ``unified_attention``) and is compared
with tests/adapters_reference.py's float64 attention: its 2D path (prefill
chunks, mixed steps, more sequences than ``128 / KV heads``), its 3D path
(few sequences of short queries: the launches say 16 segments), every variant,
fp8 with a scale, float32 (TF32 products: a looser tolerance). ALiBi with a
sink is checked against the kernel's own origin, ``slope * (k - context_len)``,
and shown to differ from the spec's ``slope * (k - p)`` there. The kernel files
come from the installed vLLM or the pinned wheel (skipped, saying why, where
neither can be had; a failure under CI).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from adapters_reference import check, kernels_or_skip, make_case, run, worst

from conformance.interpreter import honest_interpreter
from conformance.observe.launches import recording
from conformance.observe.paths import observe
from spec.attention import AttentionVariant
from spec.errors import InvalidRequestError
from spec.kv_geometry import KVGeometry


@pytest.fixture(scope="module")
def adapter() -> Iterator[Any]:
    from conformance.adapters import vllm_unified

    kernels_or_skip(vllm_unified.vllm_kernels)
    with honest_interpreter():
        yield vllm_unified


SINKS4 = (1.0, 2.0, -1.0, 0.5)
SLOPES4 = (0.5, 0.25, 0.125, 0.0625)
CASES = [
    ("fp16 decodes: 3D", dict(seqs=[(40, 1), (17, 1)]), 16),
    ("fp16 mixed step: 2D", dict(seqs=[(0, 20), (33, 1), (10, 5)]), 1),
    ("bf16 speculative rows: 3D", dict(seqs=[(30, 4), (50, 3)], dtype="bfloat16"), 16),
    ("fp32 block 32, GQA 3", dict(seqs=[(70, 2), (9, 7)], dtype="float32", block_size=32,
                                  kv_heads=1, heads=3), 16),
    ("fp16 window, softcap, sinks", dict(seqs=[(60, 1), (20, 6)], variant=AttentionVariant(
        window=9, softcap=5.0, sinks=SINKS4)), 16),
    ("fp16 ALiBi, head dim 96", dict(seqs=[(25, 2)], head_dim=96, variant=AttentionVariant(
        alibi_slopes=SLOPES4)), 16),
    ("fp8 e4m3, scale 0.5", dict(seqs=[(25, 1), (5, 9)], kv_dtype="fp8_e4m3", kv_scale=0.5), 1),
]  # fmt: skip


@pytest.mark.parametrize(("label", "kw", "parts"), CASES, ids=[c[0] for c in CASES])
def test_the_adapter_matches_the_float64_reference(
    adapter: Any, label: str, kw: dict[str, object], parts: int
) -> None:
    case = make_case(21, label=label, **kw)  # type: ignore[arg-type]
    backend = adapter.VllmUnifiedBackend()
    with recording() as launches:
        check(backend, case)
    seen = observe([x for x in launches if x.kernel != "reshape_and_cache_kernel_flash"])
    assert seen.unread == () and seen.parts == parts, seen


def test_alibi_with_a_sink_biases_from_the_context_not_the_query(adapter: Any) -> None:
    """``alibi_offset = seq_offset - context_len``: a constant per row, until a sink joins."""
    variant = AttentionVariant(sinks=SINKS4, alibi_slopes=SLOPES4)
    case = make_case(22, [(12, 6)], dtype="float32", variant=variant, label="ALiBi + sinks")
    out = run(adapter.VllmUnifiedBackend(), case)
    kernels = worst(case, out, alibi_origin="context")
    assert kernels < 1e-2
    assert worst(case, out) > 10 * kernels  # the spec's slope * (k - p): a real difference


def test_it_refuses_what_the_kernel_cannot_run(adapter: Any) -> None:
    backend = adapter.VllmUnifiedBackend()
    caps = backend.capabilities
    assert caps.products == "tf32" and caps.kv_dtypes == frozenset({"fp8_e4m3"})
    assert caps.table_width is not None and caps.table_width >= 256
    g = KVGeometry(1, 8, 8, 2, 16, dtype="float16")
    assert caps.unsupported(g, 4) == ["block size 8", "head dim 16"]
    with pytest.raises(InvalidRequestError, match="vllm-unified: block size 8, head dim 16"):
        backend.create_cache(g)
    e5m2 = KVGeometry(1, 8, 16, 2, 64, kv_dtype="fp8_e5m2", kv_scales=((1.0, 1.0),))
    assert caps.unsupported(e5m2, 4) == ["KV dtype fp8_e5m2"]


def test_its_kv_write_is_exact_and_skips_padding(adapter: Any) -> None:
    backend = adapter.VllmUnifiedBackend(tensors="numpy")
    backend.create_cache(KVGeometry(1, 4, 16, 2, 64, dtype="float16"))
    rng = np.random.default_rng(0)
    k = rng.normal(size=(3, 2, 64)).astype(np.float32)
    v = rng.normal(size=(3, 2, 64)).astype(np.float32)
    k, v = (np.asarray(x, dtype=np.float32) for x in (k.astype("float16"), v.astype("float16")))
    backend.write_kv(0, k, v, [5, -1, 40])
    kc, vc = backend.read_cache(0)
    assert np.array_equal(kc[0, 5], k[0]) and np.array_equal(vc[2, 8], v[2])
    assert np.isnan(kc.reshape(64, 2, 64)[[0, 1, 6]]).all()  # nothing else written
