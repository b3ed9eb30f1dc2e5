"""The pytest base class a third party subclasses to run the whole suite in their own tests.

One combined class, so that nothing is forgotten: subclass it, supply a
``backend`` fixture, and every check runs::

    import pytest
    from conformance.testing import BackendConformance
    from my_engine import MyBackend

    class TestMyBackend(BackendConformance):
        @pytest.fixture
        def backend(self):
            return MyBackend()

Class attributes tune the run: ``conformance_profile`` (``"quick"`` unless the
``PAGED_SPEC_PROFILE`` environment variable says otherwise),
``conformance_seed``, ``conformance_dtypes``, and ``backend_ref``, the name a
failure's replay script uses to load the backend (by default the backend's
class, as ``module:Class``).
"""

from __future__ import annotations

import os

import numpy as np

from conformance.plan import plan_for
from conformance.report import text_report
from conformance.runner import PROFILES, run_suite
from spec.backend import DTYPES, Backend, Capabilities, KVGeometry

PROFILE_ENV_VAR = "PAGED_SPEC_PROFILE"


class BackendConformance:
    """Every conformance check, against the backend that the ``backend`` fixture returns."""

    conformance_profile: str | None = None
    conformance_seed: int | None = None
    conformance_dtypes: tuple[str, ...] | None = None
    backend_ref: str | None = None

    def test_satisfies_the_backend_protocol(self, backend: Backend) -> None:
        assert isinstance(backend, Backend), "missing methods: see docs/plugging-in.md"
        caps = backend.capabilities
        assert isinstance(caps, Capabilities), "capabilities must be a spec.backend.Capabilities"
        assert caps.dtypes and caps.dtypes <= set(DTYPES), f"dtypes {set(caps.dtypes)}"
        plan_for(caps, self.conformance_dtypes)  # raises SetupError if nothing can run

    def test_write_then_read_returns_the_values_exactly(self, backend: Backend) -> None:
        dtype = sorted(backend.capabilities.dtypes)[0]
        g = KVGeometry(
            num_layers=1,
            num_blocks=2,
            block_size=_block_size(backend),
            num_kv_heads=1,
            head_dim=_head_dim(backend),
            dtype=dtype,
        )
        backend.create_cache(g)
        rows = np.arange(g.head_dim, dtype=np.float32).reshape(1, 1, g.head_dim) / 4
        backend.write_kv(0, rows, -rows, slot_mapping=[g.block_size])  # block 1, offset 0
        k, v = backend.read_cache(0)
        assert np.array_equal(np.asarray(k)[1, 0], rows[0]), "K did not read back exactly"
        assert np.array_equal(np.asarray(v)[1, 0], -rows[0]), "V did not read back exactly"

    def test_lockstep_with_the_spec(self, backend: Backend) -> None:
        profile = self.conformance_profile or os.environ.get(PROFILE_ENV_VAR, "quick")
        assert profile in PROFILES, f"{PROFILE_ENV_VAR}={profile!r}: choose from {list(PROFILES)}"
        ref = self.backend_ref or f"{type(backend).__module__}:{type(backend).__qualname__}"
        result = run_suite(
            backend,
            ref,
            profile=profile,
            run_seed=self.conformance_seed,
            dtypes=self.conformance_dtypes,
        )
        if not result.passed:
            raise AssertionError(text_report(result))


def _block_size(backend: Backend) -> int:
    sizes = backend.capabilities.block_sizes
    return 4 if sizes is None or 4 in sizes else min(sizes)


def _head_dim(backend: Backend) -> int:
    dims = backend.capabilities.head_dims
    return 8 if dims is None or 8 in dims else min(dims)
