"""How many sequences fit, found by running the spec's allocator rather than a formula.

A model's layers become KV cache groups (:mod:`spec.kv_groups`) laid out
the way a server lays them out over one shared pool of blocks
(:mod:`spec.cache_manager` states the bytes): the full-attention and the
windowed layers are cut into groups of equal size ``gcd(full, windowed)``
layers, so a block of ``B`` tokens of any group costs the same bytes, and a
model with a fixed per-sequence state gets a state group, whose slots are a
second pool. Then sequences are admitted one after another, each prefilled in
chunks and decoding its last token, through :class:`spec.cache_manager.CacheManager`,
until one does not fit.

With a state group the two pools split the memory: ``k`` state slots, and
the blocks the rest pays for. The split is searched (``k = 1, 2, ...``)
and the best reported: each extra slot adds a sequence until the blocks run
out first, after which more slots only take blocks away.

>>> from paged_spec.capacity import PRESETS
>>> fit = allocator_fit(PRESETS["hybrid-27b"], context=32_768)
>>> fit.sequences, fit.state_slots, fit.blocks, fit.block_bytes // MIB
(10, 10, 22419, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spec.cache_manager import FIXED_STATE, FULL_ATTENTION, CacheManager, sliding_window
from spec.kv_budget import MIB, kv_bytes_per_token, latent_bytes_per_token
from spec.kv_groups import KVCacheGroup
from spec.kv_memory import check_latent

__all__ = ["MIB", "AllocatorFit", "GroupLayout", "ModelKV", "allocator_fit", "group_layout"]

CHUNK = 512
"""Tokens a step prefills of one sequence (the scheduler's chunk): a window holds its own
``w`` positions plus the chunk's while a long prompt is being prefilled."""


@dataclass(frozen=True)
class ModelKV:
    """A model's KV geometry, its fixed per-sequence state, and a scenario to size.

    ``num_layers`` counts only the layers that cache K and V (a hybrid model's
    ``state_layers`` linear-attention layers keep ``state_bytes`` per sequence
    instead); ``window_layers`` of them see only the last ``window`` tokens.
    ``latent_dim`` is the latent layout of multi-head latent attention
    (:class:`spec.kv_geometry.KVGeometry`): one row of ``head_dim`` a layer, of
    which ``latent_dim`` is c_kv, and one KV head.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    state_bytes: int = 0
    context: int = 4096  # the context a typical sequence reaches
    max_len: int = 4096  # what a contiguous allocator must reserve
    pool_bytes: int = 0  # KV memory left on the device after weights and reserve
    block_size: int = 16
    weights_bytes: int = 0  # the weights, taken from a device budget (``--device-gb``)
    window_layers: int = 0  # layers with a sliding window of ``window`` tokens
    window: int | None = None
    state_layers: int = 0  # the layers whose state ``state_bytes`` is (for the report)
    latent_dim: int | None = None  # latent layout: rows of head_dim, latent_dim of them c_kv

    def __post_init__(self) -> None:
        check_latent(self.latent_dim, self.num_kv_heads, self.head_dim)

    def bytes_per_token(self, num_layers: int | None = None) -> int:
        """KV bytes of one token over ``num_layers`` layers (default: all of them): K and V of
        every KV head, or one latent row a layer (:mod:`spec.kv_budget`)."""
        layers = self.num_layers if num_layers is None else num_layers
        if self.latent_dim is None:
            return kv_bytes_per_token(layers, self.num_kv_heads, self.head_dim, self.dtype_bytes)
        rope = self.head_dim - self.latent_dim
        return latent_bytes_per_token(layers, self.latent_dim, rope, self.dtype_bytes)

    @property
    def has_groups(self) -> bool:
        """Whether the model keeps more than one kind of memory (state, windows)."""
        return bool(self.state_bytes or self.window_layers)


@dataclass(frozen=True)
class GroupLayout:
    """A model's KV cache groups over one shared pool: ``layers`` layers per paged group."""

    groups: tuple[KVCacheGroup, ...]
    layers: int
    block_bytes: int

    def describe(self, model: ModelKV) -> str:
        """``full x8 layers, window 1,024 x40 layers (5 groups of 8)``, and any state."""
        parts = []
        full = model.num_layers - model.window_layers
        for name, count in (("full", full), (f"window {model.window or 0:,}", model.window_layers)):
            if count:
                split = (
                    f" ({count // self.layers} groups of {self.layers})"
                    if count > self.layers
                    else ""
                )
                parts.append(f"{name} x{count} layers{split}")
        if model.state_bytes:
            layers = f" x{model.state_layers} layers" if model.state_layers else ""
            parts.append(f"state{layers} ({_mib(model.state_bytes)} a sequence)")
        return ", ".join(parts)


@dataclass(frozen=True)
class AllocatorFit:
    """Sequences of ``context`` tokens the allocator admitted, and the pools' split."""

    context: int
    sequences: int
    state_slots: int  # the state pool's size (0 without a state group)
    blocks: int  # the block pool's size
    block_bytes: int


def group_layout(model: ModelKV, *, release: bool = True) -> GroupLayout:
    """The model's groups; with ``release=False`` the windowed layers keep every block."""
    if not 0 <= model.window_layers <= model.num_layers or (
        model.window_layers and not model.window
    ):
        raise ValueError(
            f"{model.name}: window_layers must be 0..num_layers ({model.num_layers}) and need "
            f"a window, got {model.window_layers} with window {model.window}"
        )
    full = model.num_layers - model.window_layers
    size = math.gcd(full, model.window_layers)
    window = sliding_window(model.window) if model.window and release else FULL_ATTENTION
    groups = (FULL_ATTENTION,) * (full // size) + (window,) * (model.window_layers // size)
    if model.state_bytes:
        groups += (FIXED_STATE,)
    per_layer = model.bytes_per_token(num_layers=1)
    return GroupLayout(groups, size, model.block_size * size * per_layer)


def allocator_fit(model: ModelKV, context: int, *, release: bool = True) -> AllocatorFit:
    """Admit ``context``-token sequences into ``model``'s pools until one does not fit."""
    layout = group_layout(model, release=release)
    state = model.state_bytes
    if not state:
        blocks = model.pool_bytes // layout.block_bytes
        return AllocatorFit(
            context, _admitted(layout, model, blocks, 0, context), 0, blocks, layout.block_bytes
        )
    best = AllocatorFit(context, 0, 0, model.pool_bytes // layout.block_bytes, layout.block_bytes)
    for slots in range(1, model.pool_bytes // state + 1):
        blocks = (model.pool_bytes - slots * state) // layout.block_bytes
        if blocks < 1:
            break
        n = _admitted(layout, model, blocks, slots, context)
        if n > best.sequences:
            best = AllocatorFit(context, n, slots, blocks, layout.block_bytes)
        if n < slots:  # the blocks ran out first: more slots only take blocks away
            break
    return best


def _admitted(layout: GroupLayout, model: ModelKV, blocks: int, slots: int, context: int) -> int:
    """How many sequences of ``context`` tokens one after another fit the pools."""
    if blocks < 1:
        return 0
    windowed = any(g.kind == "window" for g in layout.groups)
    chunk = CHUNK if windowed else context  # without a window, chunking changes nothing
    cache = CacheManager(
        blocks,
        model.block_size,
        groups=layout.groups,
        num_state_slots=slots,
        max_chunk_tokens=chunk,
    )
    prompt = [0] * (context - 1)
    for seq in range(blocks * model.block_size + 1):
        if not _one_sequence(cache, seq, prompt, chunk, commit=windowed):
            return seq
    raise AssertionError("unreachable: the pool holds fewer tokens than this")


def _one_sequence(
    cache: CacheManager, seq: int, prompt: list[int], chunk: int, commit: bool
) -> bool:
    """Prefill ``prompt`` in chunks, then decode one token; False at the first refusal.

    Each step is laid out (``commit``) when a window must see its tokens
    computed before it can release what they no longer need.
    """
    if not cache.can_admit(prompt or [0], chunk):
        return False
    done = cache.admit(seq, prompt or [0], chunk).new_tokens
    steps = [min(chunk, len(prompt) - d) for d in range(done, len(prompt), chunk)] + [1]
    if commit:
        cache.layout([(seq, done)])
    for k in steps if prompt else []:
        if not cache.can_grow(seq, k):
            return False
        cache.grow(seq, [0] * k)
        if commit:
            cache.layout([(seq, k)])
    return True


def _mib(n: int) -> str:
    return f"{n // MIB:,} MiB" if n % MIB == 0 else f"{n / MIB:,.2f} MiB"
