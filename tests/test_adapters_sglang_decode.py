"""SGLang's Triton decode adapter, checked by hand against a float64 reference.

Decodes through :mod:`conformance.adapters.sglang_decode` against
tests/adapters_reference.py: the grouped kernel (GQA; float32 in TF32), the MHA
kernel (one query head per KV head: products rounded to the activation dtype,
checked against a reference that rounds them so), sinks and soft-capping, fp8
caches of both formats with a scale (the MHA kernel keeps Q as it is: a tight
check of the scales; the grouped one casts Q to fp8: checked against a
reference that rounds Q so). Two of SGLang's own behaviours are pinned here as
the engine has them: a window layer's decode reads ``w - 1`` keys, and an fp8
e5m2 write overflows to infinity. Skipped, saying why, where the kernel files
cannot be had (a failure under CI).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from adapters_reference import check, kernels_or_skip, make_case, run, worst

from conformance.interpreter import honest_interpreter
from spec.attention import AttentionVariant
from spec.errors import InvalidRequestError
from spec.kv_geometry import KVGeometry


@pytest.fixture(scope="module")
def adapter() -> Iterator[Any]:
    from conformance.adapters import sglang_decode

    kernels_or_skip(sglang_decode.sglang_kernels)
    with honest_interpreter():
        yield sglang_decode


SINKS4 = (1.0, 2.0, -1.0, 0.5)
CASES = [
    ("fp16 GQA 2", dict(seqs=[(40, 1), (17, 1), (2, 1)])),
    ("fp32 GQA 4, head dim 80", dict(seqs=[(100, 1)], dtype="float32", kv_heads=1, heads=4,
                                     head_dim=80)),
    ("bf16 sinks and softcap", dict(seqs=[(50, 1), (3, 1)], dtype="bfloat16",
                                    variant=AttentionVariant(softcap=5.0, sinks=SINKS4))),
    ("fp16 block 5, 300 keys", dict(seqs=[(300, 1)], block_size=5)),
]  # fmt: skip


@pytest.mark.parametrize(("label", "kw"), CASES, ids=[c[0] for c in CASES])
def test_the_adapter_matches_the_float64_reference(
    adapter: Any, label: str, kw: dict[str, Any]
) -> None:
    check(adapter.SglangDecodeBackend(), make_case(41, label=label, **kw))


def test_one_query_head_per_kv_head_rounds_its_products(adapter: Any) -> None:
    """``_fwd_kernel_stage1``: ``qk = tl.sum((q[None, :] * k).to(tl.float32), 1)``."""
    case = make_case(42, [(200, 1), (9, 1)], heads=2, label="MHA")
    out = run(adapter.SglangDecodeBackend(), case)
    assert worst(case, out, round_products="float16") < 2e-3


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_caches(adapter: Any, fmt: str) -> None:
    mha = make_case(43, [(25, 1), (40, 1)], heads=2, kv_dtype=fmt, kv_scale=0.5, label="MHA")
    check(adapter.SglangDecodeBackend(), mha)  # Q as it is: the scales, tightly
    gqa = make_case(43, [(25, 1), (40, 1)], heads=4, kv_dtype=fmt, kv_scale=0.5, label="GQA")
    out = run(adapter.SglangDecodeBackend(), gqa)  # q.to(K_Buffer.dtype.element_ty)
    assert worst(gqa, out, prefix_query=fmt) < 0.1 < worst(gqa, out)


def test_a_window_layer_reads_one_key_fewer(adapter: Any) -> None:
    """``window_kv_lens = torch.minimum(seq_lens, sliding_window_size)``, with
    ``sliding_window_size = w - 1``: the decode sees ``w - 1`` keys, the spec ``w``."""
    case = make_case(44, [(50, 1), (3, 1)], variant=AttentionVariant(window=8), label="window")
    out = run(adapter.SglangDecodeBackend(), case)
    engines = worst(case, out, window=7)
    assert engines < 2e-3 and worst(case, out) > 5 * engines


def test_an_e5m2_write_overflows_to_infinity(adapter: Any) -> None:
    """``cache_k.to(self.dtype)``: torch's e5m2 cast does not saturate (e4m3's does)."""
    backend = adapter.SglangDecodeBackend()
    for fmt, stored in (("fp8_e5m2", float("inf")), ("fp8_e4m3", 448.0)):
        backend.create_cache(KVGeometry(1, 2, 4, 1, 16, kv_dtype=fmt, kv_scales=((1.0, 1.0),)))
        big = torch.full((1, 1, 16), 1e5, dtype=torch.float32)
        backend.write_kv(0, big, big, torch.tensor([3]))
        k, _ = backend.read_blocks(0, [0])
        assert float(k[0, 3, 0, 0].float()) == stored


def test_the_path_it_names_is_the_split_the_kernel_ran(adapter: Any) -> None:
    backend = adapter.SglangDecodeBackend()
    for keys, path in ((32, "single-pass decode"), (33, "split-KV decode")):
        run(backend, make_case(45, [(keys - 1, 1)], label=f"{keys} keys"))
        assert backend.attention_path() == path
    assert [adapter.parts_of(n, 8) for n in (32, 33, 1000)] == [1, 2, 8]


def test_it_refuses_what_the_kernel_cannot_run(adapter: Any) -> None:
    backend = adapter.SglangDecodeBackend()
    caps = backend.capabilities
    g = KVGeometry(1, 8, 16, 2, 8)
    assert caps.unsupported(g, 4) == ["head dim 8 with GQA (a tl.dot dimension under 16)"]
    assert caps.unsupported(g, 2, AttentionVariant(window=1)) == [
        "a window of 1 token (sliding_window_size = w - 1 = 0 turns SGLang's window off)"
    ]
    assert caps.unsupported(g, 2, AttentionVariant(alibi_slopes=(1.0, 1.0))) == [
        "attention variant alibi"
    ]
    case = make_case(46, [(5, 2)], label="prefill")
    with pytest.raises(InvalidRequestError, match="decode only"):
        run(backend, case, declared=False)
    assert not np.isnan(run(backend, make_case(46, [(5, 1)]))).any()
