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

Class attributes tune the run: ``conformance_profile`` (``"quick"`` by
default), ``conformance_seed``, ``conformance_dtypes``,
``conformance_examples``, ``conformance_control`` (a
:class:`~conformance.run.control.RunControl`), and ``backend_ref``, the name a
failure's replay script uses to load the backend (by default the backend's
class, as ``module:Class``), ``conformance_shard`` (one
:class:`~conformance.run.shard.Shard` of the run's examples),
``conformance_database`` (a directory or Redis URL, :mod:`conformance.run.database`;
``None``: none), ``conformance_report`` and ``conformance_junit`` (paths the
lockstep's JSON and JUnit reports are written to). The ``PAGED_SPEC_*`` environment variables
(:data:`conformance.run.control.ENVIRONMENT`) override them, so that a person
running the tests can reproduce a seed or bound a run without editing code.

The run is in process: the backend is the fixture's object. Set
``conformance_isolated = True`` (with a ``backend_ref`` that loads it) to run it
in a child process instead, as ``python -m conformance run`` does, so that a
crash or a native hang is reported rather than taking pytest down. Every run
prints its verdict and seed in pytest's terminal summary, passing or not.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conformance.errors import SetupError
from conformance.judges.device_contract import DeviceContract, uses_device_contract
from conformance.lockstep.plan import plan_for
from conformance.lockstep.workload import kv_parts
from conformance.reports.report import summary_lines, text_report, write_json, write_junit
from conformance.run.control import RunControl, environment_options
from conformance.run.isolation import Request, database_arg, run_isolated
from conformance.run.profiles import PROFILES
from conformance.run.result import RunResult
from conformance.run.runner import DATABASE_DIR, run_suite
from conformance.run.shard import Shard
from spec.backend import Backend, FloatArray
from spec.capabilities import Capabilities
from spec.kv_geometry import DTYPES, KVGeometry

PROFILE_ENV_VAR = "PAGED_SPEC_PROFILE"
_PLUGIN = "paged-spec-conformance-summary"


class BackendConformance:
    """Every conformance check, against the backend that the ``backend`` fixture returns."""

    conformance_profile: str | None = None
    conformance_seed: int | None = None
    conformance_dtypes: tuple[str, ...] | None = None
    conformance_examples: int | None = None
    conformance_control: RunControl | None = None
    conformance_isolated: bool = False
    conformance_shard: Shard | None = None
    conformance_database: Path | str | None = DATABASE_DIR
    conformance_report: Path | None = None
    conformance_junit: Path | None = None
    backend_ref: str | None = None

    def test_satisfies_the_backend_protocol(self, backend: Backend) -> None:
        assert isinstance(backend, Backend), "missing methods: see docs/plugging-in.md"
        caps = backend.capabilities
        assert isinstance(caps, Capabilities), "capabilities must be a spec.backend.Capabilities"
        assert caps.dtypes and caps.dtypes <= set(DTYPES), f"dtypes {set(caps.dtypes)}"
        plan_for(caps, self.conformance_dtypes)  # raises SetupError if nothing can run

    def test_write_then_read_returns_the_values_exactly(self, backend: Backend) -> None:
        g = _small_geometry(backend)
        backend.create_cache(g)
        key, value = (np.arange(w, dtype=np.float32).reshape(1, 1, w) / 4 for w in g.kv_widths)
        k, v = _write_then_read(backend, g, key, -value, slot=g.block_size)  # block 1, offset 0
        names = kv_parts(g)
        assert np.array_equal(np.asarray(k)[1, 0], key[0]), f"{names[0]} did not read back exactly"
        assert np.array_equal(np.asarray(v)[1, 0], -value[0]), (
            f"{names[1]} did not read back exactly"
        )

    def test_lockstep_with_the_spec(self, backend: Backend, request: pytest.FixtureRequest) -> None:
        result = self._run_lockstep(backend)
        if result.interrupted:  # Ctrl-C during an isolated run: stop the session, as usual
            raise KeyboardInterrupt
        _summary(request.config).add(result)
        for path, write in (
            (self.conformance_report, write_json),
            (self.conformance_junit, write_junit),
        ):
            if path is not None:
                write(result, path)
        if not result.passed:
            raise AssertionError(text_report(result))

    def _run_lockstep(self, backend: Backend) -> RunResult:
        """The lockstep run, under the class attributes and the environment over them."""
        try:
            env = environment_options()
        except SetupError as err:
            pytest.fail(str(err), pytrace=False)
        profile = env.profile or self.conformance_profile or "quick"
        if profile not in PROFILES:
            pytest.fail(f"{PROFILE_ENV_VAR}={profile!r}: choose from {list(PROFILES)}", False)
        ref = self.backend_ref or f"{type(backend).__module__}:{type(backend).__qualname__}"
        seed = env.seed if env.seed is not None else self.conformance_seed
        dtypes = env.dtypes or self.conformance_dtypes
        examples = env.max_examples or self.conformance_examples
        control = _merge(self.conformance_control, env.control)
        if self.conformance_isolated:
            return run_isolated(
                Request(
                    ref,
                    profile,
                    _seed(seed),
                    None if dtypes is None else list(dtypes),
                    database_arg(self.conformance_database),
                    examples,
                    control,
                    None if self.conformance_shard is None else self.conformance_shard.describe(),
                )
            )
        return run_suite(
            backend,
            ref,
            profile=profile,
            run_seed=seed,
            dtypes=dtypes,
            max_examples=examples,
            control=control,
            database=self.conformance_database,
            shard=self.conformance_shard,
        )


def _merge(ours: RunControl | None, env: RunControl) -> RunControl:
    """The environment's knobs where set (not default), the class's elsewhere."""
    if ours is None:
        return env
    default = RunControl()
    chosen = {
        name: getattr(env, name) if getattr(env, name) != getattr(default, name) else value
        for name, value in vars(ours).items()
    }
    return RunControl(**chosen)


def _seed(seed: int | None) -> int:
    return random.randrange(2**32) if seed is None else seed


class _Summary:
    """A pytest plugin, registered by the first run: one summary per run at the session's end."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, result: RunResult) -> None:
        self.lines += summary_lines(result)
        shard = "" if result.shard is None else f" (shard {result.shard.describe()})"
        self.lines.append(f"  reproduce: PAGED_SPEC_SEED={result.seed}{shard}")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.section("paged-attention conformance")
        for line in self.lines:
            terminalreporter.write_line(line)


def _summary(config: pytest.Config) -> _Summary:
    plugin = config.pluginmanager.get_plugin(_PLUGIN)
    if not isinstance(plugin, _Summary):
        plugin = _Summary()
        config.pluginmanager.register(plugin, _PLUGIN)
    return plugin


def _write_then_read(
    backend: Backend, g: KVGeometry, key: FloatArray, value: FloatArray, slot: int
) -> tuple[object, object]:
    """``key`` and ``value`` (of ``g``'s widths) written to ``slot``; blocks 0 and 1 of layer 0
    read back.

    In the backend's own contract: numpy, or the device-resident one
    (:mod:`conformance.judges.device_contract`: tensors in, ``read_blocks`` out).
    """
    caps = backend.capabilities
    if not uses_device_contract(caps):
        backend.write_kv(0, key, value, slot_mapping=[slot])
        return backend.read_cache(0)
    dc = DeviceContract(caps, g)
    write: Callable[..., object] = backend.write_kv  # tensors: the Protocol spells numpy
    write(0, dc.activations(key.astype(np.float64)), dc.activations(value.astype(np.float64)),
          dc.slots(0, [slot]))  # fmt: skip
    read_blocks = getattr(backend, "read_blocks", None)
    assert callable(read_blocks), "the device contract needs read_blocks(layer, blocks)"
    k, v = ((2, g.block_size, g.num_kv_heads, w) for w in g.kv_widths)
    names = kv_parts(g)
    return dc.blocks("read_blocks(0, [0, 1])", read_blocks(0, [0, 1]), k, value_shape=v,
                     names=names)  # fmt: skip


def _small_geometry(backend: Backend) -> KVGeometry:
    """A one-layer pool of two blocks in the backend's first dtype: one KV head of its
    smallest head dim, or, for a backend that runs the latent layout alone (an MLA kernel),
    one of its latent layouts (8 + 4 when it declares any)."""
    caps = backend.capabilities
    dtype = sorted(caps.dtypes)[0]
    g = KVGeometry(1, 2, _block_size(backend), 1, _head_dim(backend), dtype)
    if not caps.unsupported(g, 1) or caps.latent == frozenset():
        return g
    latent, rope = (8, 4) if caps.latent is None else min(caps.latent)
    return KVGeometry(1, 2, g.block_size, 1, latent + rope, dtype, latent_dim=latent)


def _block_size(backend: Backend) -> int:
    sizes = backend.capabilities.block_sizes
    return 4 if sizes is None or 4 in sizes else min(sizes)


def _head_dim(backend: Backend) -> int:
    dims = backend.capabilities.head_dims
    return 8 if dims is None or 8 in dims else min(dims)
