"""Which reference judges a step: the spec's numpy one, or the fast tiled one on the device.

The spec (:func:`spec.attention.paged_attention`) is the definition and judges
every small step: it is what a reader checks the suite against. Two things
move a step to the fast reference (:mod:`conformance.judges.fast_reference`,
the same arithmetic in torch float64, tiled under a memory limit):

* **size**: a step whose cost, the sum over its sequences of query tokens x
  visible keys x query heads, reaches :data:`FAST_THRESHOLD` (33.5 million:
  the spec's float64 score matrix of the step alone is then 256 MiB, and it
  holds several; a prefill chunk of 2,048 over 8,192 keys with 32 heads is
  537 million, 4 GiB a matrix);
* **device**: every step of a backend whose ``capabilities.device`` is not
  ``"cpu"``, computed on that device, so the reference runs where the kernel
  runs.

The fast reference is trusted because it is checked: in
``tests/test_fast_reference.py`` over every variant, and at start-up
(:func:`startup_check`) on a tiny batch against the spec on the device it
will run on. Its float64 outputs differ from the spec's only in the order of
summation (a few float64 ulps); its same-precision outputs within
:data:`conformance.judges.numerics.FAST_SLACK_ULPS`, which the judge adds to
its floor for the steps it judges, and for those only.

>>> OracleChoice("cpu", DEFAULT_MEMORY_LIMIT).choose(cost=10, device="cpu")
'spec'
>>> OracleChoice("cpu", DEFAULT_MEMORY_LIMIT).choose(cost=FAST_THRESHOLD, device="cpu")
'fast'
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from conformance.errors import SetupError
from conformance.judges.dtypes import F64
from conformance.judges.fast_reference import (
    DeviceUnavailableError,
    PagedKV,
    paged_attention,
    resolve_device,
    same_precision,
)
from conformance.judges.resident_kv import ResidentKV
from conformance.judges.tile_plan import DEFAULT_MEMORY_LIMIT, MemoryLimitError
from spec.attention import AttentionVariant
from spec.attention_batched import paged_attention_batched as spec_attention
from spec.batch import PAD_BLOCK, BatchMetadata
from spec.errors import InvalidRequestError
from spec.kv_memory import KVMemory

SPEC, FAST = "spec", "fast"
FAST_THRESHOLD = 1 << 25
"""Steps costing at least this many query x key x head products go to the fast reference.

33.5 million: where the spec's float64 scores of one step reach 256 MiB (it
holds several such temporaries at once). Below it every step of the CPU
envelope, long prompts included (at most 1,024 x 1,100 x 8 = 9 million), is
judged by the definition itself, with none of the slack the fast reference's
steps get. That costs little: on such steps the fast reference is faster on a
CPU, but only by a fraction of a second a step.
"""
MEMORY_ENV = "PAGED_SPEC_REFERENCE_MEMORY"
"""Environment variable with the fast reference's memory limit in bytes (``--reference-memory``)."""
ORACLE_NAMES = {
    SPEC: "the spec's numpy float64 reference",
    FAST: "the fast reference (torch float64, tiled)",
}


def layer_cache(
    choice: OracleChoice, memory: KVMemory, layer: int, batch: BatchMetadata, group: int
) -> PagedKV:
    """The fast reference's view of ``layer`` for one step, moving as little as it can.

    A :class:`~conformance.judges.resident_kv.ResidentKV` on the device hands
    over its resident copy (nothing moves); a whole memory on the CPU is read in
    place; otherwise the blocks the step reads are sent.
    """
    if isinstance(memory, ResidentKV) and str(memory.device) == choice.device:
        return memory.layer_cache(layer)
    if choice.device == "cpu" and not memory.lazy:
        return PagedKV.from_memory(memory, layer, "cpu")
    return sent_cache(choice, memory, layer, batch, group)


def sent_cache(
    choice: OracleChoice, memory: KVMemory, layer: int, batch: BatchMetadata, group: int
) -> PagedKV:
    """The blocks of ``layer`` that the step reads, copied to the oracle's device."""
    blocks = sorted({b for row in batch.tables(group) for b in row if b != PAD_BLOCK})
    return PagedKV.from_memory(memory, layer, choice.device, blocks=blocks)


def step_cost(batch: BatchMetadata, num_heads: int) -> int:
    """Query tokens x visible keys x query heads, summed over the step's sequences."""
    lens = np.asarray(batch.seq_lens, dtype=np.int64)
    queries = np.diff(np.asarray(batch.query_start_loc, dtype=np.int64))
    return int((lens * queries).sum()) * num_heads


def memory_limit_from(value: str | None) -> int:
    """A memory limit given as bytes (suffixes K, M, G accepted); the default when ``None``.

    Raises :class:`ValueError` naming a bad value (an argparse ``type``).

    >>> memory_limit_from("2G"), memory_limit_from(None) == DEFAULT_MEMORY_LIMIT
    (2147483648, True)
    """
    if value is None or value == "":
        return DEFAULT_MEMORY_LIMIT
    text = value.strip().upper()
    factor = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if factor > 1 else text
    try:
        limit = int(digits) * factor
    except ValueError:
        raise ValueError(
            f"reference memory {value!r} is not a byte count (for example 1073741824 or 1G)"
        ) from None
    if limit < 1:
        raise ValueError(f"reference memory must be positive, got {value!r}")
    return limit


@dataclass(frozen=True)
class OracleChoice:
    """The run's reference settings: the device the fast reference runs on and its memory limit."""

    device: str
    memory_limit: int
    resident: bool = False  # the spec's memory kept on the device (conformance.judges.resident_kv)
    fast: bool = True  # False: torch is not installed, the spec judges every step

    def choose(self, cost: int, device: str) -> str:
        """``"fast"`` for a large step or a backend not on the CPU, else ``"spec"`` (always
        ``"spec"`` without the fast reference)."""
        if not self.fast:
            return SPEC
        return FAST if device != "cpu" or cost >= FAST_THRESHOLD else SPEC

    def note(self) -> str:
        """What a report says of the references when they are not the usual pair: without
        torch, the spec judges every step ("" otherwise)."""
        if self.fast:
            return ""
        return (
            f"{ORACLE_NAMES[SPEC]}, every step: torch is not installed, so the fast reference "
            "is off (pip install 'paged-spec[torch]' brings it)"
        )


def oracle_for_run(backend_device: str, memory_limit: int | None = None) -> OracleChoice:
    """The run's choice, after the start-up checks; :class:`SetupError` naming what is wrong.

    The device is the backend's when it is a torch device this machine has
    (a backend on ``cuda:0`` gets its reference on ``cuda:0``); the limit is
    ``memory_limit``, else :data:`MEMORY_ENV`, else 1 GiB.
    """
    env_limit = os.environ.get(MEMORY_ENV)
    try:
        limit = memory_limit if memory_limit is not None else memory_limit_from(env_limit)
    except ValueError as e:
        raise SetupError(f"{MEMORY_ENV}: {e}") from None
    return _checked_choice(backend_device, limit)


@functools.lru_cache(maxsize=8)
def _checked_choice(backend_device: str, limit: int) -> OracleChoice:
    """Once per device and limit in a process: resolve the device and run the start-up check.

    Without torch, a backend on the CPU is judged by the spec alone (the base install);
    a backend elsewhere needs torch anyway, and is told so.
    """
    if backend_device == "cpu" and importlib.util.find_spec("torch") is None:
        return OracleChoice("cpu", limit, fast=False)
    try:
        dev = str(resolve_device(backend_device))
    except DeviceUnavailableError as e:
        raise SetupError(f"the fast reference cannot run on the backend's device: {e}") from e
    choice = OracleChoice(dev, limit, resident=dev != "cpu")
    startup_check(choice)
    return choice


def startup_check(choice: OracleChoice) -> None:
    """The fast reference against the spec on a tiny batch of ``choice.device``; SetupError if not.

    Two sequences (a prefill of 5 and a decode at 9), GQA 2, blocks of 4, in
    float64 and in the same-precision arithmetic of fp16: float64 outputs
    must agree within 1e-12, the same-precision ones within one fp16 ulp.
    """
    from spec.batch import build_batch
    from spec.block_manager import BlockManager

    manager = BlockManager(num_blocks=8, block_size=4)
    memory = KVMemory(1, 8, 4, num_kv_heads=1, head_dim=8, lazy=False)
    rng = np.random.default_rng(23)

    def append(seq: int, n: int) -> None:
        slots = manager.append_slots(seq, list(range(n)))
        memory.write(0, rng.normal(size=(n, 1, 8)), rng.normal(size=(n, 1, 8)), slots)

    manager.add_sequence(1, list(range(8)))
    append(1, 8)
    build_batch(manager, [(1, 8)])  # sequence 1's prompt, laid out before its decode
    manager.add_sequence(0, list(range(5)))
    append(0, 5)
    append(1, 1)
    batch = build_batch(manager, [(0, 5), (1, 1)])
    query = rng.normal(size=(batch.num_tokens, 2, 8))
    try:
        cache = PagedKV.from_memory(memory, 0, choice.device)
        fast = paged_attention(query, batch, cache, memory_limit=choice.memory_limit)
        from conformance.judges.numerics import same_precision as spec_same

        same = paged_attention(
            query,
            batch,
            cache,
            precision=same_precision("float16", False),
            memory_limit=choice.memory_limit,
        )
    except MemoryLimitError as e:
        raise SetupError(f"reference memory {choice.memory_limit} bytes: {e}") from e
    exact = spec_attention(query, batch, memory, 0)
    spec_same_out = spec_attention(query, batch, memory, 0, precision=spec_same("float16", False))
    bad_exact = float(np.abs(fast.cpu().numpy() - exact).max())
    bad_same = float(np.abs(same.cpu().numpy() - spec_same_out).max())
    if bad_exact > 1e-12 or bad_same > 2.0**-10:
        raise SetupError(
            f"the fast reference on {choice.device} disagrees with the spec on the start-up "
            f"check (float64: {bad_exact:.3g} apart, fp16 same-precision: {bad_same:.3g}); "
            "the suite will not judge with it"
        )


def reference_outputs(
    choice: OracleChoice,
    query: F64,
    batch: BatchMetadata,
    memory: KVMemory,
    layer: int,
    *,
    scale: float,
    variant: AttentionVariant,
    group: int,
    dtype: str,
    quantized_kv: bool,
    oracle: str,
    products: str = "exact",
    kv_dtype: str | None = None,
) -> tuple[F64, F64]:
    """The float64 and same-precision references of one step and layer, by ``oracle``; the
    same-precision one rounds products as the backend declares (``products``, ``kv_dtype``).

    An out-of-memory error of the fast reference is a :class:`SetupError`
    naming :data:`MEMORY_ENV` and ``--reference-memory``: the suite's limit,
    not the backend, is what must change.
    """
    if oracle == SPEC:
        from conformance.judges.numerics import same_precision as spec_same

        args = (query, batch, memory, layer, scale)
        try:
            exact = spec_attention(*args, variant=variant, group=group)
            precision = spec_same(dtype, quantized_kv, products, kv_dtype)
            same = spec_attention(*args, variant=variant, group=group, precision=precision)
        except MemoryError as e:
            raise SetupError(
                f"the spec's reference ran out of memory at a step of {batch.num_seqs} sequences "
                f"and {batch.num_tokens} query tokens: give the suite's process more memory"
            ) from e
        return exact, same
    try:
        cache = layer_cache(choice, memory, layer, batch, group)
        limit = choice.memory_limit
        exact_t = paged_attention(
            query, batch, cache, scale, variant=variant, group=group, memory_limit=limit
        )
        same_t = paged_attention(
            query,
            batch,
            cache,
            scale,
            variant=variant,
            group=group,
            precision=same_precision(dtype, quantized_kv, products, kv_dtype),
            memory_limit=limit,
        )
    except MemoryLimitError as e:
        raise SetupError(f"{e}; raise --reference-memory (or {MEMORY_ENV})") from e
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "out of memory" not in str(e).lower():
            raise
        raise SetupError(
            f"the suite's fast reference ran out of memory on {choice.device} at a step of "
            f"{batch.num_seqs} sequences and {batch.num_tokens} query tokens under a limit of "
            f"{choice.memory_limit} bytes: lower --reference-memory (or {MEMORY_ENV}) to tile "
            "smaller, or free memory on the device"
        ) from e
    except InvalidRequestError:
        raise
    return exact_t.cpu().numpy(), same_t.cpu().numpy()
