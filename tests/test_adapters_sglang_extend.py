"""SGLang's Triton extend adapter, checked by hand against a float64 reference.

Prefill chunks after cached context beside one-token extends (how SGLang's
mixed chunked prefill runs decodes), float32 in TF32, every variant it has
(a window of ``w`` keys, exact here unlike the decode kernel's), under both
contracts (the device contract hands the chunk's K and V to attention; the
numpy contract takes them from the layer's last write), and an fp8 cache,
whose prefix product casts Q and P to fp8 (checked loosely, against a
reference that rounds Q so). Skipped, saying why, where the kernel files cannot
be had (a failure under CI).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from adapters_reference import check, kernels_or_skip, make_case, run, worst

from conformance.interpreter import honest_interpreter
from spec.attention import AttentionVariant
from spec.errors import InvalidRequestError


@pytest.fixture(scope="module")
def adapter() -> Iterator[Any]:
    from conformance.adapters import sglang_extend

    kernels_or_skip(sglang_extend.sglang_kernels)
    with honest_interpreter():
        yield sglang_extend


SINKS4 = (1.0, 2.0, -1.0, 0.5)
CASES = [
    ("fp16 mixed step", dict(seqs=[(40, 1), (0, 17), (10, 5)])),
    ("fp32 GQA 3", dict(seqs=[(100, 3), (0, 4)], dtype="float32", kv_heads=1, heads=3)),
    ("bf16 sinks and softcap", dict(seqs=[(50, 4), (3, 1)], dtype="bfloat16",
                                    variant=AttentionVariant(softcap=5.0, sinks=SINKS4))),
    ("fp16 window of 8", dict(seqs=[(50, 6), (3, 1), (0, 20)],
                              variant=AttentionVariant(window=8))),
]  # fmt: skip


@pytest.mark.parametrize("tensors", ["torch", "numpy"])
@pytest.mark.parametrize(("label", "kw"), CASES, ids=[c[0] for c in CASES])
def test_the_adapter_matches_the_float64_reference(
    adapter: Any, label: str, kw: dict[str, Any], tensors: str
) -> None:
    check(adapter.SglangExtendBackend(tensors=tensors), make_case(51, label=label, **kw))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_caches_cast_the_prefix_query(adapter: Any, fmt: str) -> None:
    case = make_case(52, [(25, 3), (30, 1)], heads=4, kv_dtype=fmt, kv_scale=0.5, label=fmt)
    out = run(adapter.SglangExtendBackend(), case)
    assert worst(case, out, prefix_query=fmt) < 0.35


def test_it_refuses_what_the_kernel_cannot_run(adapter: Any) -> None:
    backend = adapter.SglangExtendBackend(tensors="numpy")
    case = make_case(53, [(5, 2)], label="chunk")
    backend.create_cache(case.geometry)
    with pytest.raises(InvalidRequestError, match="write_kv this batch's slots"):
        backend.attention(0, case.query.astype("float32"), case.batch, case.scale)
    alibi = AttentionVariant(alibi_slopes=(1.0, 1.0, 1.0, 1.0))
    assert backend.capabilities.unsupported(case.geometry, 4, alibi) == ["attention variant alibi"]
