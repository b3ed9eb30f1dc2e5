"""A failure's cause is what explains it, and the report counts causes, not failing passes.

A kernel whose float32 products take TF32 operands fails wherever float32 is
drawn, whatever variant the layer has: the TF32 recomputation reproduces its
outputs, so every such failure is one cause, and each pass goes on without
float32 only (its bfloat16 examples still run, and pass). A kernel that
multiplies the V of masked slots by a zero weight fails on NaN poison: no
named mistake reproduces a NaN, but the failing workload replayed with finite
values in the slots no token owns passes, so that is the cause, and the rest of
the pass runs with finite poison. A failure nothing explains is "not isolated".
Probabilities rounded after normalising (an eager softmax, then ``P @ V``) are a
named mistake, and a precision a backend may declare.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conformance.interpreter.arithmetic import tf32
from conformance.judges.dtypes import round_to
from conformance.judges.hypotheses import Case, Mistake, attend_with, diagnose
from conformance.judges.numerics import same_precision
from conformance.lockstep.numpy_backend import F32, Ints, NumpyPagedBackend
from conformance.planted.backends import MasksByZeroWeight
from conformance.reports.report import json_report, text_report
from conformance.run.control import RunControl
from conformance.run.failures import by_cause
from conformance.run.result import RunResult
from conformance.run.runner import run_suite
from spec.attention import AttentionVariant
from spec.attention_batched import paged_attention_batched
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_memory import KVMemory

SEED = 3


def _tf32(x: F32) -> F32:
    out: F32 = tf32(np.asarray(x, np.float32)).astype(np.float32)
    return out


class Tf32Products(NumpyPagedBackend):
    """float32 ``Q @ K`` and ``P @ V`` on TF32 operands, P unnormalised (a float32 ``tl.dot`` at
    its default precision on NVIDIA GPUs); every variant, and the rest exact."""

    @property
    def capabilities(self) -> Capabilities:
        caps = super().capabilities
        return replace(caps, variants=frozenset({"sinks", "alibi"}), kv_dtypes=frozenset())

    def _attend(
        self,
        q: F32,
        k: F32,
        v: F32,
        visible: np.typing.NDArray[np.bool_],
        scale: float,
        positions: Ints,
        variant: AttentionVariant,
    ) -> F32:
        if self._geo().dtype != "float32":
            return super()._attend(q, k, v, visible, scale, positions, variant)
        q, k, v = _tf32(q), _tf32(k), _tf32(v)
        out = np.zeros((*q.shape[:2], v.shape[2]), dtype=np.float32)
        for h in range(q.shape[1]):
            kv = self._kv_head(h, q.shape[1], k.shape[1])
            s = (q[:, h] @ k[:, kv].T) * np.float32(scale)
            if variant.alibi_slopes is not None:
                s = self._alibi(s, positions, variant.alibi_slopes[h])
            s = np.where(visible, s, np.float32(-np.inf))
            top = s.max(axis=-1, keepdims=True)
            sink = None if variant.sinks is None else np.float32(variant.sinks[h])
            if sink is not None:
                top = np.maximum(top, sink)
            w = np.exp(s - top)
            total = w.sum(axis=-1, keepdims=True)
            if sink is not None:
                total = total + np.exp(sink - top)
            out[:, h] = (_tf32(w) @ v[:, kv]) / total
        return out


@pytest.fixture(scope="module")
def tf32_run() -> RunResult:
    return run_suite(
        Tf32Products(), "tf32", run_seed=SEED, database=None, dtypes=["float32", "bfloat16"],
        control=RunControl(shrink=False), passes=("short", "feature"), max_examples=12,
    )  # fmt: skip


def test_tf32_products_under_two_variants_are_one_cause(tf32_run: RunResult) -> None:
    assert not tf32_run.passed
    causes = {f.cause for f in tf32_run.failures}
    assert causes == {"float32 products rounded to TF32"}, causes
    assert len(tf32_run.failures) >= 2  # found in several passes: still one cause
    assert len(by_cause(tf32_run.failures)) == 1
    text = text_report(tf32_run)
    assert f"FAILURES: 1 distinct cause, in {len(tf32_run.failures)} failing passes" in text
    assert json_report(tf32_run)["distinct_failures"] == 1


def test_excluding_tf32_removes_float32_only(tf32_run: RunResult) -> None:
    redrawn = [name for name, _ in tf32_run.passes if name.endswith(", without float32")]
    assert redrawn, tf32_run.passes  # each failing pass drawn again, without float32 alone
    failed = {f.pass_name for f in tf32_run.failures}
    assert not failed & set(redrawn)  # ... and its float16 examples, with both variants, pass
    assert tf32_run.stats.drawn["bfloat16"] > 0 and tf32_run.stats.drawn["sinks"] > 0


def test_nan_from_unowned_memory_is_one_cause_and_the_pass_goes_on_with_finite_poison() -> None:
    result = run_suite(
        MasksByZeroWeight(), "x", run_seed=SEED, database=None,
        control=RunControl(shrink=False), passes=("short",),
    )  # fmt: skip
    assert [f.isolated for f in result.failures] == [True]
    assert result.failures[0].cause and "reads slots no token owns" in result.failures[0].cause
    names = [name for name, _ in result.passes]
    assert names == ["short", "short, without non-finite poison"]  # and then it passes
    assert "the output is not finite where the reference is" in text_report(result)


def test_reads_of_unowned_slots_are_one_cause_whatever_poison_each_pass_drew() -> None:
    result = run_suite(
        MasksByZeroWeight(), "x", run_seed=SEED, database=None,
        control=RunControl(shrink=False), passes=("short", "wide", "long"),
    )  # fmt: skip
    assert len(result.failures) == 3 and all(f.isolated for f in result.failures)
    assert len(by_cause(result.failures)) == 1, [f.cause for f in result.failures]
    assert "FAILURES: 1 distinct cause, in 3 failing passes" in text_report(result)


def test_finite_poison_is_a_declared_choice_and_the_verdict_says_so() -> None:
    result = run_suite(
        MasksByZeroWeight(), "x", run_seed=SEED, database=None,
        control=RunControl(poison="finite"), passes=("short",), max_examples=12,
    )  # fmt: skip
    assert result.passed, result.difference and result.difference.describe()
    first = text_report(result).splitlines()[0]
    assert first.endswith(
        "PASSED (reads of slots no token owns were not judged for NaN: --poison finite)"
    )


def _normalised_case() -> tuple[Case, np.typing.NDArray[np.float64]]:
    """One step of 3 queries over 40 keys, and what a kernel that rounds the normalised P to
    float16 before ``P @ V`` computes for it (float32 otherwise)."""
    rng = np.random.default_rng(0)
    k, v = rng.normal(size=(40, 1, 16)), rng.normal(size=(40, 1, 16))
    q = rng.normal(size=(3, 2, 16)) * 2.0
    positions = np.array([37, 38, 39])
    case = Case(q, [(k, v, positions, 0)], 0.5, AttentionVariant(), (1.0, 1.0), dtype="float16")
    out = np.zeros((3, 2, 16))
    for h in range(2):
        s = (q[:, h] @ k[:, 0].T) * 0.5
        s = np.where(np.arange(40)[None] <= positions[:, None], s, -np.inf)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        p = round_to((w / w.sum(axis=-1, keepdims=True)).astype(np.float32), "float16")
        out[:, h] = p.astype(np.float32) @ v[:, 0].astype(np.float32)
    return case, round_to(out, "float16")


def test_probabilities_rounded_after_normalising_are_named() -> None:
    case, actual = _normalised_case()
    exact = attend_with(case, Mistake())
    assert exact is not None
    said = diagnose(case, exact, actual)
    assert said is not None and "probabilities rounded after normalising" in said


def test_a_declared_normalised_rounding_is_what_the_same_precision_reference_computes() -> None:
    case, actual = _normalised_case()
    memory = KVMemory(1, 10, 4, 1, 16)
    k, v, _, _ = case.keys[0]
    memory.write(0, k, v, list(range(40)))
    batch = BatchMetadata(4, (0,), (0, 3), (40,), (tuple(range(10)),), (37, 38, 39), (37, 38, 39))
    precision = same_precision("float16", False, products="normalised")
    same = paged_attention_batched(case.query, batch, memory, 0, 0.5, precision=precision)
    plain = paged_attention_batched(case.query, batch, memory, 0, 0.5,
                                    precision=same_precision("float16", False))  # fmt: skip
    off = np.abs(round_to(same, "float16") - actual).max()
    assert off < np.abs(round_to(plain, "float16") - actual).max()
    assert off <= 2 * float(np.abs(actual).max()) * 2.0**-11
