"""vLLM's Triton MLA decode adapter, checked by hand against a float64 reference.

Latent rows (c_kv and k_rope side by side, one KV head) of 32 + 16, 16 + 16 and
DeepSeek's 512 + 64; two query heads or more (the grouped kernel: float16 and
bfloat16 exact, float32 in TF32) and one (the MHA kernel, whose products are
rounded to the activation dtype: checked against a reference that rounds them
so); an fp8 cache with a scale; the split count the launches show, against
``_compute_num_kv_splits``'s rule. Skipped, saying why, where the kernel files
cannot be had (a failure under CI).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
    from conformance.adapters import vllm_mla

    kernels_or_skip(vllm_mla.vllm_kernels)
    with honest_interpreter():
        yield vllm_mla


LATENT: dict[str, Any] = {"latent_dim": 32, "head_dim": 48, "kv_heads": 1}
CASES = [
    ("fp16, 2 heads", dict(seqs=[(40, 1), (17, 1)], heads=2), 1),
    ("bf16 16+16, 8 heads", dict(seqs=[(40, 1)], heads=8, dtype="bfloat16", latent_dim=16,
                                 head_dim=32), 1),
    ("fp32, 4 heads, 1,100 keys: 2 splits", dict(seqs=[(1100, 1), (30, 1)], heads=4,
                                                 dtype="float32"), 2),
    ("fp16 512+64, 16 heads", dict(seqs=[(20, 1)], heads=16, latent_dim=512, head_dim=576), 1),
    ("fp8 e4m3, scale 0.5", dict(seqs=[(25, 1), (3, 1)], heads=4, kv_dtype="fp8_e4m3",
                                 kv_scale=0.5), 1),
]  # fmt: skip


@pytest.mark.parametrize(("label", "kw", "parts"), CASES, ids=[c[0] for c in CASES])
def test_the_adapter_matches_the_float64_reference(
    adapter: Any, label: str, kw: dict[str, Any], parts: int
) -> None:
    case = make_case(31, label=label, **(LATENT | kw))
    with recording() as launches:
        check(adapter.VllmMlaBackend(), case)
    seen = observe(launches)
    assert seen.unread == () and seen.parts == parts, seen


def test_one_query_head_takes_the_float16_mha_kernel(adapter: Any) -> None:
    """``kv_group_num == 1``: ``_fwd_kernel_stage1``, whose ``qk = tl.sum(q[None, :] * k, 1)``
    multiplies and sums in the activation dtype (``tl.sum`` keeps float16), several times the
    grouped kernel's error on the same keys: still the right attention, rounded coarser."""
    errors = {}
    for heads in (1, 2):
        case = make_case(32, [(300, 1), (60, 1)], heads=heads, label=f"{heads} heads", **LATENT)
        with recording() as launches:
            out = run(adapter.VllmMlaBackend(), case)
        kernels = {x.kernel for x in launches}
        assert ("_fwd_kernel_stage1" in kernels) == (heads == 1), kernels
        errors[heads] = worst(case, out)
    assert errors[2] < 2e-3 and 3 * errors[2] < errors[1] < 2e-2, errors


def test_the_declared_split_rule_is_the_kernels(adapter: Any) -> None:
    caps = adapter.VllmMlaBackend().capabilities
    split = caps.decode_split
    assert split is not None and (split.min_keys, split.part_keys) == (1024, 512)
    assert [adapter.num_kv_splits(n, 132) for n in (1023, 1024, 2048)] == [1, 2, 4]


def test_it_refuses_what_the_kernel_cannot_run(adapter: Any) -> None:
    backend = adapter.VllmMlaBackend()
    caps = backend.capabilities
    small = KVGeometry(1, 8, 16, 1, 16, latent_dim=8)
    assert caps.unsupported(small, 2) == ["latent layout 8+8: a part under 16 columns"]
    assert caps.unsupported(KVGeometry(1, 8, 16, 2, 64), 4) == [
        "per-head K and V (vllm-mla runs the latent layout only)"
    ]
    assert caps.unsupported(KVGeometry(1, 8, 16, 1, 48, latent_dim=32), 2, AttentionVariant(
        window=4)) == ["attention variant window"]  # fmt: skip
    assert caps.max_query_len == 1 and caps.query_unsupported(2, 10) is not None
    with pytest.raises(InvalidRequestError, match="latent layout 8\\+8"):
        backend.create_cache(small)
    case = make_case(33, [(5, 2)], heads=2, **LATENT)
    with pytest.raises(InvalidRequestError, match="decode only"):
        run(backend, case, declared=False)
