"""Backends that misbehave in the ways a suite must survive: each factory is one way.

Each is a correct numpy backend (:class:`conformance.lockstep.numpy_backend.NumpyPagedBackend`)
with one method changed, named on the command line as
``tests/misbehaving_backends.py:FACTORY``. They exit, hang, crash the
process, answer differently on replay, write into their inputs, or hand out
live views of their cache; ``tests/test_conformance_isolation.py`` checks that
each ends as a reported conformance failure, never as a pass or a silent stop.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from conformance.lockstep.numpy_backend import NumpyPagedBackend
from spec.attention import AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchMetadata
from spec.capabilities import Capabilities
from spec.kv_geometry import KVGeometry


class _Float32Only(NumpyPagedBackend):
    """One dtype, so that runs stay short."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(name=type(self).__name__, dtypes=frozenset({"float32"}))


class ExitsInAttention(_Float32Only):
    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        sys.exit(0)


MARKER_VAR = "MISBEHAVING_BACKEND_MARKER"
"""When set, a hanging backend first starts a helper process and writes both pids there."""


class HangsInAttention(_Float32Only):
    """Sleeps in ``attention``; with :data:`MARKER_VAR`, after starting a helper process."""

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        marker = os.environ.get(MARKER_VAR)
        if marker:
            helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            Path(marker).write_text(f"{os.getpid()} {helper.pid}")
        time.sleep(3600)
        return super().attention(layer, query, batch, scale, variant=variant)


class RaisesKeyboardInterrupt(_Float32Only):
    """Raises ``KeyboardInterrupt`` itself, with no Ctrl-C pressed."""

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        raise KeyboardInterrupt


class AbortsInAttention(_Float32Only):
    """``abort()``: what glibc does on heap corruption ("free(): invalid pointer")."""

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
        os.abort()


class SegfaultsInWriteKV(_Float32Only):
    """A read of address 0, at the first write after the background: a native kernel's bug."""

    def create_cache(self, geometry: KVGeometry) -> None:
        super().create_cache(geometry)
        self._writes = 0

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        self._writes += 1
        if self._writes > self._geo().num_layers:  # past the background write of step 0
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            ctypes.string_at(0)
        super().write_kv(layer, key, value, slot_mapping)


class ExitsHardInCopy(_Float32Only):
    """``os._exit``: no exception, no cleanup, the process is simply gone."""

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        os._exit(3)


_calls = 0


class WrongOnceInAttention(_Float32Only):
    """Corrupts the output of its fifth attention call in the process, and never again."""

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        global _calls
        _calls += 1
        out = super().attention(layer, query, batch, scale)
        return out + 1.0 if _calls == 5 else out


class WritesIntoQuery(_Float32Only):
    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        query[0, 0, 0] = 0.0  # raises: the suite passes it read-only
        return super().attention(layer, query, batch, scale, variant=variant)


class WritesIntoKeyNatively(_Float32Only):
    """Writes through the raw pointer, as native code does: the read-only flag cannot stop it."""

    def write_kv(
        self, layer: int, key: FloatArray, value: FloatArray, slot_mapping: Sequence[int]
    ) -> None:
        super().write_kv(layer, key, value, slot_mapping)
        key_array = np.asarray(key)
        ctypes.memset(key_array.ctypes.data, 0, key_array.itemsize)


class ReturnsLiveViews(_Float32Only):
    """``read_cache`` returns the cache itself rather than a copy."""

    def create_cache(self, geometry: KVGeometry) -> None:
        super().create_cache(geometry)
        self._k = [k.astype(np.float32) for k in self._k]
        self._v = [v.astype(np.float32) for v in self._v]

    def read_cache(self, layer: int) -> tuple[FloatArray, FloatArray]:
        return self._k[layer], self._v[layer]


_caches = 0


class WrongThenExitsWhileShrinking(_Float32Only):
    """Every output off by one; the process exits at its second cache: as shrinking starts."""

    def create_cache(self, geometry: KVGeometry) -> None:
        global _caches
        _caches += 1
        if _caches == 2:
            os._exit(3)
        super().create_cache(geometry)

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        return super().attention(layer, query, batch, scale, variant=variant) + 1.0
