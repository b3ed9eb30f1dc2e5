"""What the suite draws for KV cache groups, from a backend's capabilities.

A backend that declares :attr:`~spec.capabilities.Capabilities.kv_groups` gets a
pass of examples (the ``groups`` pass of :data:`conformance.lockstep.plan.PASSES`)
whose layers form :data:`GROUPS` groups, each with its own block tables over
one shared pool (:mod:`spec.cache_manager`):

* group 0 is full attention; group 1 is a sliding window of 1 to 3 blocks
  (at, one past, or one short of a block boundary), so that short examples
  already release blocks, when the backend declares the ``window`` variant,
  and full attention otherwise (two tables that name different blocks are
  enough to tell a layer that reads the wrong group's table);
* every layer of a windowed group attends with exactly the group's window:
  it never needs a block the group released
  (:meth:`conformance.lockstep.workload.WorkloadConfig.kv_cache_groups`);
* layers are assigned to groups in every order, each group holding one at
  least; the layout shrinks towards ``(0, ..., 0, 1)`` and a window of one block.

>>> from hypothesis import find
>>> from spec.backend import Capabilities
>>> find(group_layouts(Capabilities("x", kv_groups=True, variants={"window"}), 2, 4), bool)
LayerGroups(layer_groups=(0, 1), windows=(None, 4))
>>> find(group_layouts(Capabilities("x", kv_groups=True), 3, 4), bool)
LayerGroups(layer_groups=(0, 0, 1), windows=(None, None))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hypothesis import strategies as st

from conformance.lockstep.envelope import Envelope
from conformance.lockstep.workload import WorkloadConfig
from spec.attention import AttentionVariant
from spec.capabilities import Capabilities

GROUPS = 2
"""KV cache groups of a groups-pass example: full attention, and a window (or full)."""
WINDOW_BLOCKS = (1, 2, 3)
"""A windowed group's window, in blocks: short, so that short examples release blocks."""
WINDOW_OFFSETS = (0, 1, -1)
"""Tokens past a whole number of blocks: at, just past and just short of a boundary."""


@dataclass(frozen=True)
class LayerGroups:
    """Each layer's KV cache group, and each group's window (``None``: full attention)."""

    layer_groups: tuple[int, ...]  # the group of each layer
    windows: tuple[int | None, ...]  # per group: None for full attention, else w tokens

    def variants(self, drawn: Sequence[AttentionVariant]) -> tuple[AttentionVariant, ...]:
        """The drawn per-layer variants, each windowed group's layers seeing exactly its window."""
        return tuple(
            v if self.windows[g] is None else replace(v, window=self.windows[g])
            for v, g in zip(drawn, self.layer_groups, strict=True)
        )


def group_kv_heads(env: Envelope, kv_heads: tuple[int, ...]) -> tuple[int, ...]:
    """KV head counts of a groups example: one layer per group fits the cost bound."""
    bound = env.bound("groups")
    return tuple(k for k in kv_heads if bound is None or k * GROUPS <= bound) or kv_heads[:1]


def group_layer_counts(env: Envelope, num_kv_heads: int) -> tuple[int, ...]:
    """Layer counts of a groups example: one layer per group at least, under the cost bound."""
    bound = env.bound("groups")
    fits = [n for n in env.layers if n >= GROUPS and (bound is None or n * num_kv_heads <= bound)]
    return tuple(fits) or (GROUPS,)


def group_layouts(
    caps: Capabilities, num_layers: int, block_size: int
) -> st.SearchStrategy[LayerGroups]:
    """Layer-to-group assignments using every group, and the groups' windows."""
    orders = [
        x for x in itertools.product(range(GROUPS), repeat=num_layers) if len(set(x)) == GROUPS
    ]
    if "window" not in caps.variants:
        windows: st.SearchStrategy[int | None] = st.none()
    else:
        windows = st.builds(
            lambda blocks, offset: max(1, blocks * block_size + offset),
            st.sampled_from(WINDOW_BLOCKS),
            st.sampled_from(WINDOW_OFFSETS),
        )
    return st.builds(
        lambda order, w: LayerGroups(order, (None, w)), st.sampled_from(orders), windows
    )


def group_skips(caps: Capabilities) -> list[str]:
    """What the groups pass leaves out for a backend, and why."""
    if not caps.kv_groups:
        return [
            "KV cache groups (a block table per group of layers): capabilities.kv_groups is False"
        ]
    if "window" not in caps.variants:
        return [
            "sliding-window KV cache groups (released blocks): the window variant is not "
            "declared; the groups pass draws two full-attention groups"
        ]
    return []


def group_label(config: WorkloadConfig) -> str:
    """What a workload's shape line adds for KV cache groups: each layer's group and windows.

    >>> from spec.backend import KVGeometry
    >>> g = KVGeometry(2, 8, 4, 1, 8, layer_groups=(1, 0))
    >>> group_label(WorkloadConfig(g, 1, 0.3, 0, group_windows=(None, None)))
    ' groups 1,0 full/full'
    """
    if not config.group_windows:
        return ""
    order = ",".join(str(config.geometry.group_of(x)) for x in range(config.geometry.num_layers))
    kinds = "/".join("full" if w is None else f"window{w}" for w in config.group_windows)
    return f" groups {order} {kinds}"
