"""The FlexAttention adapter checked by hand, then by a reduced run of the suite.

The hand checks run :mod:`conformance.adapters.flex` on small cases against the
plain float64 reference of tests/adapters_reference.py: shuffled block tables,
prefill chunks after context beside decodes, GQA ratios 1, 2 and 3, block sizes
that are and are not powers of two, every variant, each dtype; with finite
values in the slots no token owns, since the eager path multiplies them by a zero
weight (a separate test shows the NaN that follows from NaN there, the finding the
suite reports under its default poison). The run is the suite's own, reduced to
the short and feature passes, under ``--poison finite``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from adapters_reference import check, make_case, run

from conformance.adapters.flex import POOL_LIMIT, EagerFlexBackend, FlexBackend, make_backend
from conformance.run.control import RunControl
from conformance.run.runner import run_suite
from spec.attention import AttentionVariant
from spec.errors import InvalidRequestError
from spec.kv_geometry import KVGeometry

SINKS4 = (1.0, 2.0, -1.0, 0.5)
SLOPES4 = (0.5, 0.25, 0.125, 0.0625)
CASES = [
    ("fp16 mixed step, GQA 2", dict(seqs=[(40, 1), (0, 17), (10, 5)])),
    ("fp32 block 3, GQA 3", dict(seqs=[(30, 3), (7, 1)], dtype="float32", block_size=3,
                                 kv_heads=2, heads=6)),
    ("bf16 MHA, head dim 80", dict(seqs=[(20, 1), (5, 9)], dtype="bfloat16", kv_heads=3,
                                   heads=3, head_dim=80)),
    ("fp16 every variant", dict(seqs=[(50, 4), (3, 1)], variant=AttentionVariant(
        window=9, softcap=5.0, sinks=SINKS4, alibi_slopes=SLOPES4))),
    ("fp32 ALiBi and sinks, prefill rows", dict(seqs=[(12, 6)], dtype="float32",
                                                variant=AttentionVariant(sinks=SINKS4,
                                                                         alibi_slopes=SLOPES4))),
    ("fp16 window of 1", dict(seqs=[(9, 3)], variant=AttentionVariant(window=1))),
]  # fmt: skip
EXACT = {"float32": 1e-5}  # eager: float32 products and sums, no TF32


@pytest.mark.parametrize(("label", "kw"), CASES, ids=[c[0] for c in CASES])
def test_the_adapter_matches_the_float64_reference(label: str, kw: dict[str, object]) -> None:
    case = make_case(11, label=label, fill_unowned=True, **kw)  # type: ignore[arg-type]
    check(EagerFlexBackend(), case, EXACT.get(case.geometry.dtype))


def test_the_device_contract_gives_the_same_outputs() -> None:
    case = make_case(12, [(33, 2), (4, 1)], fill_unowned=True, label="device contract")
    eager = run(EagerFlexBackend(), case)
    resident = run(FlexBackend("cpu", tensors="torch"), case)
    assert np.array_equal(eager, resident)


def test_nan_in_a_slot_no_token_owns_reaches_every_output() -> None:
    """The eager path's ``post_mod_scores.to(query.dtype) @ value``: 0 x NaN is NaN."""
    case = make_case(13, [(20, 1)], spare_blocks=2, label="NaN left in the spare blocks")
    out = run(EagerFlexBackend(), case)
    assert np.isnan(out).all()


def test_it_declares_what_the_eager_path_does() -> None:
    caps = EagerFlexBackend().capabilities
    assert caps.products == "normalised" and caps.kv_dtypes == frozenset()
    assert caps.block_sizes is None and caps.head_dims is None and caps.tensors == "numpy"
    assert getattr(EagerFlexBackend(), "read_blocks", None) is None  # no large-pool pass
    big = KVGeometry(1, POOL_LIMIT // 64 + 1, 8, 1, 8, dtype="float16")
    assert caps.unsupported(big, 1) == [
        f"a pool of {POOL_LIMIT + 64:,} elements a layer: flex's eager path converts and "
        f"scores the whole pool at every call (at most {POOL_LIMIT:,} here)"
    ]
    with pytest.raises(InvalidRequestError, match="flex: a pool of"):
        EagerFlexBackend().create_cache(big)
    fp8 = KVGeometry(1, 4, 4, 1, 8, kv_dtype="fp8_e4m3", kv_scales=((1.0, 1.0),))
    assert caps.unsupported(fp8, 1) == ["KV dtype fp8_e4m3"]
    if not torch.cuda.is_available():
        assert isinstance(make_backend(), EagerFlexBackend)


def test_a_reduced_suite_run_passes_with_finite_poison() -> None:
    """The short and feature passes of ``paged-spec run --backend flex --poison finite``."""
    result = run_suite(
        make_backend(), "flex", run_seed=3, database=None, max_examples=4,
        control=RunControl(poison="finite", long_examples=0, shrink=False),
        passes=("short", "feature"),
    )  # fmt: skip
    assert result.passed, result.difference
    assert result.control.poison == "finite"
