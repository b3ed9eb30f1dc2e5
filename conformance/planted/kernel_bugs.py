"""Bugs planted in the project's real Triton kernels, each where only a GPU's launch plan looks.

The other planted bugs are models (numpy backends that compute a bug); these
are the kernels themselves, changed in one place. Each :class:`Mutation` is a
copy of one module of :mod:`backend_gpu.kernels` with one text replaced (it
must occur exactly once), written to a private folder and imported under its
own name, so that Triton interprets or compiles it like any other project's
kernel; the backend is :class:`~backend_gpu.triton_backend.TritonBackend` with
that module's entry point in place of the project's. Every one of them passes
a run whose decodes are never split into more than a few parts, whose latent
examples have 16 query heads or fewer, and whose latent pool stays below 2^31
elements; the suite must reach the H200's plan to catch them
(:mod:`conformance.planted.selftest` runs them).
"""

from __future__ import annotations

# isort: split
# First: on a CPU-only machine this sets TRITON_INTERPRET, which must happen before triton
# is first imported (kernels are interpreted or compiled when they are decorated).
import backend_gpu  # noqa: F401

# isort: split
import functools
import hashlib
import importlib.util
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

from backend_gpu.triton_backend import TritonBackend
from spec.capabilities import Capabilities


@dataclass(frozen=True)
class Mutation:
    """One change to one kernel module: ``old`` (found exactly once) becomes ``new``."""

    module: str  # the module changed, e.g. "backend_gpu.kernels.attention"
    old: str
    new: str


@functools.cache
def _folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="paged-spec-planted-kernels-"))


@functools.cache
def mutant(mutation: Mutation) -> ModuleType:
    """The kernel module of ``mutation`` with its change, imported (once per process)."""
    original = importlib.util.find_spec(mutation.module)
    assert original is not None and original.origin is not None, mutation.module
    source = Path(original.origin).read_text()
    found = source.count(mutation.old)
    if found != 1:
        raise RuntimeError(
            f"the planted change to {mutation.module} expects its text once, found {found} "
            f"times: {mutation.old!r}"
        )
    digest = hashlib.sha256(repr(mutation).encode()).hexdigest()[:12]
    name = f"paged_spec_planted_{mutation.module.rsplit('.', 1)[-1]}_{digest}"
    path = _folder() / f"{name}.py"
    path.write_text(source.replace(mutation.old, mutation.new))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and Triton look their module up by name
    spec.loader.exec_module(module)
    return module


class _KernelBug(TritonBackend):
    """The Triton backend with one entry point taken from a :func:`mutant` module."""

    mutation: Mutation
    entry: tuple[str, str]  # (the backend's attribute, the module's function)
    selftest_passes: tuple[str, ...]  # the passes that reach the bug's path
    selftest_bounds: str | None = None  # a bounds check, where the bug writes outside memory

    def __init__(self) -> None:
        super().__init__()
        attribute, function = self.entry
        setattr(self, attribute, getattr(mutant(self.mutation), function))

    @property
    def capabilities(self) -> Capabilities:
        return replace(super().capabilities, name=type(self).__name__)


_ATTENTION = "backend_gpu.kernels.attention"
_LATENT = "backend_gpu.kernels.latent_attention"
_LATENT_WRITE = "backend_gpu.kernels.latent_write"


class MergeWithoutRunningMax(_KernelBug):
    """Each split stores its log-sum-exp without its running max (``log2(l)``, not ``m +
    log2(l)``), so the merge weighs the parts wrongly: any decode split into two parts or
    more shows it (the H200 plan splits from 1,024 keys; the feature passes open with one)."""

    mutation = Mutation(
        _ATTENTION,
        "acc, m_i, l_i, v_scale,",
        "acc, tl.zeros_like(m_i), l_i, v_scale,",
    )
    entry = ("_paged_attention", "paged_attention")
    selftest_passes = ("feature",)


class MergeReadsEightParts(_KernelBug):
    """The merge reads at most 8 partial results (its tile of parts capped at 8): right for
    every split the CPU's own plan makes (4 parts at most), wrong past 8 parts (the H200 plan
    splits one decode of 4,097 keys into 9: the split pass)."""

    mutation = Mutation(
        _ATTENTION,
        "SPLIT_PAD=next_pow2(plan.num_splits),",
        "SPLIT_PAD=min(8, next_pow2(plan.num_splits)),",
    )
    entry = ("_paged_attention", "paged_attention")
    selftest_passes = ("split",)


class LatentHeadTileReadsFirstHeads(_KernelBug):
    """Every head tile of the latent kernel loads the first tile's query heads (``head %
    HEADS``) and stores to its own: right with 16 query heads or fewer (one tile), wrong
    for DeepSeek-V3's 128 (8 tiles of 16 on the H200 plan: the latent production shape)."""

    mutation = Mutation(
        _LATENT,
        "q_row = q_ptr + row_off[:, None] * stride_qt + head[:, None] * stride_qh",
        "q_row = q_ptr + row_off[:, None] * stride_qt + (head % HEADS)[:, None] * stride_qh",
    )
    entry = ("_latent_attention", "paged_latent_attention")
    selftest_passes = ("production",)


class LatentWriteInt32Rows(_KernelBug):
    """The latent write computes a row's offset in int32 (``slot * width``), which wraps
    once a row lies past 2^31 elements: only a latent large pool shows it. The wrapped
    store lands gigabytes before the cache (on a GPU, an illegal address; under the
    interpreter, this process's memory), so the selftest runs it under the bounds check,
    which refuses the store and reports it."""

    mutation = Mutation(
        _LATENT_WRITE,
        "slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)",
        "slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int32)",
    )
    entry = ("_write_latent", "write_latent")
    selftest_passes = ("large pool",)
    selftest_bounds = "default"


PLANTED_KERNELS: dict[str, type[_KernelBug]] = {
    "split-KV merge: a part's log-sum-exp without its running max": MergeWithoutRunningMax,
    "split-KV merge: at most 8 parts read": MergeReadsEightParts,
    "latent kernel: every head tile reads the first tile's query heads": (
        LatentHeadTileReadsFirstHeads
    ),
    "latent write: row offsets in int32 (wrap past 2^31 elements)": LatentWriteInt32Rows,
}
"""Each bug planted in a real kernel, by what it gets wrong."""
