"""How a lower-precision kernel computes the same attention: the conformance suite's emulation.

The spec's attention (:mod:`spec.attention`) is float64 with nothing rounded.
A kernel in float16 or float32 is judged beside what an honest kernel of its
own precision computes (:mod:`conformance.judges.numerics`); a
:class:`Precision` names that arithmetic, and
:func:`spec.attention_batched.attend_at_precision` runs it. With
:data:`EXACT` it is the definition itself (the tests prove it equal).

>>> EXACT.exact, Precision("float32").exact
(True, False)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from spec.validate import check_choice

F64 = NDArray[np.float64]

COMPUTE_DTYPES = ("float64", "float32")
"""The dtypes the emulation computes in."""


@dataclass(frozen=True)
class Precision:
    """The arithmetic of a kernel, and what it rounds.

    The default is the spec itself: float64 throughout, probabilities
    normalised before the ``P @ V`` product. With ``compute="float32"`` every
    product and sum is float32 (float32 accumulation, as a kernel's tensor-core
    dot does); ``round_kv`` is applied to the K and V a kernel reads (an fp8
    cache dequantized to the activation dtype); ``round_p`` to the
    *unnormalised* probabilities ``exp(s - max)`` before ``P @ V``, as a
    half-precision kernel does, which then divides by their (unrounded)
    float32 sum.
    """

    compute: str = "float64"  # the dtype of every product and sum: "float64" or "float32"
    round_kv: Callable[[F64], F64] | None = None  # applied to the K and V read; None: as stored
    round_p: Callable[[F64], F64] | None = None  # applied to exp(s - max) before P @ V

    def __post_init__(self) -> None:
        check_choice("compute", self.compute, COMPUTE_DTYPES)

    @property
    def exact(self) -> bool:
        """True for the spec's own arithmetic (float64, nothing rounded)."""
        return self.compute == "float64" and self.round_kv is None and self.round_p is None


EXACT = Precision()
"""The spec's own arithmetic: float64, nothing rounded."""
