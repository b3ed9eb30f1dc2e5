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
    float32 sum; with ``p_normalised``, ``round_p`` rounds the *normalised*
    probabilities instead (an eager softmax followed by a matrix product).

    What a kernel's products round, where it declares so
    (:attr:`spec.capabilities.Capabilities.products`): ``round_dot`` is applied
    to both operands of both products (Q and K; the unnormalised P and V), as
    a float32 ``tl.dot`` in TF32 reads them; ``round_q`` to the query (a
    kernel that casts Q to the fp8 cache dtype); ``round_qk_products`` to each
    ``q_d * k_d`` before the score's sum (a kernel that rounds the products to
    save registers).

    ``p_error = (relative, absolute)`` asks for something else than an
    output: for each output, the standard deviation of the error that
    rounding each unnormalised probability (by up to ``relative`` of it, and
    at least ``absolute``: the dtype's subnormal spacing) adds to it, wherever
    a kernel rounds (:func:`spec.attention_batched.paged_attention_batched`).
    """

    compute: str = "float64"  # the dtype of every product and sum: "float64" or "float32"
    round_kv: Callable[[F64], F64] | None = None  # applied to the K and V read; None: as stored
    round_p: Callable[[F64], F64] | None = None  # applied to exp(s - max) before P @ V
    round_dot: Callable[[F64], F64] | None = None  # every product's operands (TF32)
    round_q: Callable[[F64], F64] | None = None  # the query, before Q @ K
    round_qk_products: Callable[[F64], F64] | None = None  # each q_d * k_d, before the sum
    p_normalised: bool = False  # round_p rounds P / sum(P), not exp(s - max)
    p_error: tuple[float, float] | None = None  # (relative, absolute): the spread, not the output

    def __post_init__(self) -> None:
        check_choice("compute", self.compute, COMPUTE_DTYPES)

    @property
    def exact(self) -> bool:
        """True for the spec's own arithmetic (float64, nothing rounded)."""
        rounds = (self.round_kv, self.round_p, self.round_dot, self.round_q, self.round_qk_products)
        return self.compute == "float64" and all(r is None for r in rounds) and not self.p_error


EXACT = Precision()
"""The spec's own arithmetic: float64, nothing rounded."""
