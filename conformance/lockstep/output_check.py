"""A step's attention outputs judged, and a failing one explained; an example's outputs on average.

Each layer's outputs are judged against the float64 reference beside a
same-precision one (:mod:`conformance.judges.numerics`), both from the
oracle the step's size picks (:mod:`conformance.judges.oracle`), from the KV
the spec holds once the comparison has run. A failing step is judged again
allowing for where a half-precision kernel rounds its probabilities, and a
step that still fails names the mistake that reproduces its outputs, if one
does (:mod:`conformance.judges.hypotheses`). At the end of the example, the
outputs' mean error and lean are judged, and the example's margins join the
run's only if it passed (its failure is reported on its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from conformance.errors import SetupError, SuiteStopped
from conformance.judges.compare import example_difference, first_output_difference
from conformance.judges.dtypes import F64, round_to
from conformance.judges.hypotheses import case_for, diagnose
from conformance.judges.numerics import (
    LARGE_LOGITS,
    USUAL_SCALE,
    ExampleMeter,
    Margins,
    output_errors,
    probability_rounding,
    probability_spread,
    ulp_scale,
)
from conformance.judges.oracle import (
    ORACLE_NAMES,
    SPEC,
    OracleChoice,
    reference_outputs,
    step_cost,
)
from conformance.lockstep.calls import sub_batch, token_rows
from conformance.lockstep.example import Example
from conformance.lockstep.workload import NON_FINITE, large_logits, queries
from spec.attention_batched import paged_attention_batched as spec_attention
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_memory import KVMemory

P_ROUNDING_ALLOWED = (
    "steps and layers passed allowing for where the kernel rounds probabilities (6 sigma)"
)
"""The check that counts outputs judged less :data:`~conformance.judges.numerics.PROBABILITY_SIGMAS`
of probability rounding: they failed check 1 against the reference's own rounding alone."""


class OutputCheck:
    """Judges one example's outputs against references computed from ``memory``."""

    def __init__(
        self,
        example: Example,
        memory: KVMemory,
        caps: Capabilities,
        oracle: OracleChoice,
        margins: Margins,
    ) -> None:
        self.example, self.memory, self.caps, self.oracle = example, memory, caps, oracle
        self.margins = margins  # the run's, at finish()
        self._margins = Margins()  # this example's, until it has passed
        self._meter = ExampleMeter(example.config.dtype)
        self._regime = LARGE_LOGITS if large_logits(example.config) else USUAL_SCALE
        self._oracle_used = SPEC

    def references(self, query: F64, batch: BatchMetadata, layer: int) -> tuple[F64, F64]:
        """The float64 and same-precision references, by the oracle this step's size picks."""
        c = self.example.config
        if batch.num_seqs == 0:
            empty = np.zeros((0, query.shape[1], c.geometry.value_dim))
            return empty, empty
        self._oracle_used = self.oracle.choose(step_cost(batch, c.num_heads), self.caps.device)
        try:
            return reference_outputs(
                self.oracle,
                query,
                batch,
                self.memory,
                layer,
                scale=c.scale,
                variant=c.variant(layer),
                group=c.geometry.group_of(layer),
                dtype=c.dtype,
                quantized_kv=c.geometry.kv_dtype is not None,
                oracle=self._oracle_used,
                products=self.caps.products,
                kv_dtype=c.geometry.kv_dtype,
            )
        except SetupError as e:  # the suite's limit, not the backend: out of Hypothesis untouched
            raise SuiteStopped(e) from e

    def check(
        self,
        batch: BatchMetadata,
        attended: list[int],
        outputs: Sequence[tuple[F64, F64, F64, list[str]]],
    ) -> None:
        """Each layer's ``(exact, same-precision, actual, paths)`` of the ``attended`` rows."""
        ex = self.example
        rows = [
            (batch.seq_ids[i], pos)
            for i in attended
            for pos in range(batch.seq_lens[i] - batch.query_len(i), batch.seq_lens[i])
        ]
        dtype = ex.config.dtype
        poison = ex.config.poison if ex.config.poison in NON_FINITE else None
        for layer, (exact, same, actual, paths) in enumerate(outputs):
            if not rows:
                continue
            path = "; ".join(dict.fromkeys(p for p in paths if p)) or None
            same = round_to(same, dtype)
            scale = ulp_scale(exact, dtype)
            oracle = None if self._oracle_used == SPEC else self.oracle_name()
            judge = (exact, same, actual, dtype, self._regime, path, scale, oracle)
            errors, spread = output_errors(*judge, products=self.caps.products), None
            if not errors.passed and probability_rounding(dtype) and np.isfinite(actual).all():
                spread = self._spread(batch, attended, layer)  # where the kernel rounded P
                errors = output_errors(*judge, spread=spread, products=self.caps.products)
                if errors.passed:
                    ex.checks[P_ROUNDING_ALLOWED] += 1
            self._margins.note_step(errors)
            diff = first_output_difference(
                ex.step_index, layer, exact, actual, errors, rows, poison, spread
            )
            if diff is not None:
                diff = replace(
                    diff, diagnosis=self._diagnose(batch, attended, layer, exact, actual)
                )
                ex.raise_for(ex.named(diff, layer))
            self._meter.add(exact, actual, same, scale[0])
            ex.checks["attention outputs judged against the same-precision reference"] += len(rows)
            ex.checks[f"attention outputs judged by {self.oracle_name()}"] += len(rows)

    def finish(self) -> None:
        """The example's outputs judged for mean error and lean; its margins join the run's."""
        ex = self.example
        result = self._meter.result()
        self._margins.note_example(result)
        diff = example_difference(ex.step_index, result)
        if diff is not None:
            ex.raise_for(diff)
        ex.checks["examples judged for mean error and bias (in ulps)"] += 1
        self.margins.add(self._margins)  # a passing example's: its failures are reported

    def oracle_name(self) -> str:
        name = ORACLE_NAMES[self._oracle_used]
        return name if self._oracle_used == SPEC else f"{name} on {self.oracle.device}"

    def _query(self, batch: BatchMetadata, attended: list[int], layer: int) -> F64:
        c = self.example.config
        q: F64 = queries(c, self.example.step_index, layer, batch.num_tokens)
        return q[token_rows(batch, attended)]

    def _spread(self, batch: BatchMetadata, attended: list[int], layer: int) -> F64:
        """Each attended output's sigma of probability rounding (:func:`probability_spread`),
        computed by the spec from the KV the step read."""
        c = self.example.config
        spread: F64 = spec_attention(
            self._query(batch, attended, layer),
            sub_batch(batch, attended),
            self.memory,
            layer,
            c.scale,
            variant=c.variant(layer),
            group=c.geometry.group_of(layer),
            precision=probability_spread(c.dtype),
        )
        return spread

    def _diagnose(
        self, batch: BatchMetadata, attended: list[int], layer: int, exact: F64, actual: F64
    ) -> str | None:
        """The named mistake (:mod:`conformance.judges.hypotheses`) that reproduces ``actual``."""
        c = self.example.config
        case = case_for(
            self._query(batch, attended, layer),
            sub_batch(batch, attended),
            self.memory,
            layer,
            c.geometry.group_of(layer),
            c.scale,
            c.variant(layer),
            c.dtype,
        )
        return diagnose(case, exact, actual)
