"""Scripted workloads for the planted latent KV bugs (:mod:`conformance.planted.latent`).

``test_conformance_lockstep.py`` runs each on the correct backends (it must
pass) and on its planted bug (it must be caught, as one of the listed kinds).
Each is a latent geometry of 32 + 16 with 4 query heads on the one row, and
the model's scale of a 8 + 16 wide query-key head (``1 / sqrt(24)``, not the
row's ``1 / sqrt(48)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from conformance.lockstep.driver import Lockstep
from conformance.lockstep.variants import fp8_scales
from conformance.lockstep.workload import WorkloadConfig, latent_geometry, latent_scale

HEADS = 4
LATENT, ROPE, NOPE = 32, 16, 8


def _prefill_then_decode(ls: Lockstep) -> None:
    """A 9-token prompt (B = 4: a partial last block) in two chunks, then two decodes."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    ls.add(0, prompt)
    ls.step([(0, prompt[:5])])
    ls.step([(0, prompt[5:])])
    ls.step([(0, [3])])
    ls.step([(0, [5])])


def latent_config(
    dtype: str = "float32", kv_dtype: str | None = None, large: bool = False
) -> WorkloadConfig:
    """One latent layer of 32 + 16 (blocks of 4), 4 query heads, the model's scale."""
    geometry = latent_geometry(4, LATENT, ROPE, dtype, 1)
    if kv_dtype is not None:
        geometry = replace(geometry, kv_dtype=kv_dtype, kv_scales=(fp8_scales(kv_dtype, 1.75),))
    return WorkloadConfig(geometry, HEADS, latent_scale(NOPE, ROPE, large), 19)


Workload = tuple[Callable[[Lockstep], None], WorkloadConfig, set[str]]

LATENT_WORKLOADS: dict[str, Workload] = {
    "LatentScaleFromWidth": (_prefill_then_decode, latent_config(), {"output"}),
    "LatentValueAtRope": (_prefill_then_decode, latent_config(), {"output"}),
    "LatentValueWholeRow": (_prefill_then_decode, latent_config(), {"shape"}),
    "LatentRopeLeftOut": (_prefill_then_decode, latent_config(), {"output"}),
    "LatentRowPerHead": (_prefill_then_decode, latent_config(dtype="float16"), {"output"}),
    "LatentRopeFirst": (_prefill_then_decode, latent_config(kv_dtype="fp8_e4m3"), {"c_kv"}),
    "LatentPerHeadShapes": (_prefill_then_decode, latent_config(), {"shape"}),
}
