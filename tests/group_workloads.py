"""Scripted workloads for the planted KV cache group bugs (:mod:`conformance.planted.groups`).

``test_conformance_lockstep.py`` runs each on the correct backends (it must
pass) and on its planted bug (it must be caught, as one of the listed kinds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from conformance.lockstep.driver import Lockstep
from conformance.lockstep.workload import WorkloadConfig, geometry_for, scale_for
from spec.attention import PLAIN, AttentionVariant

HEADS = 4  # two KV heads, two query heads each
WINDOW = 4  # group 1's window: one block of 4


def _past_the_window(ls: Lockstep) -> None:
    """A 9-token prompt (B = 4), three decodes (the window releases blocks 0 and 1), then a
    fork of it and a decode of both."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    ls.add(0, prompt)
    ls.step([(0, prompt)])
    for token in (3, 5, 8):
        ls.step([(0, [token])])
    ls.fork(0, 1)
    ls.step([(0, [9]), (1, [7])])


def _config() -> WorkloadConfig:
    """Layer 0 in the full-attention group, layer 1 in a window of one block."""
    geometry, heads = geometry_for(4, 2, HEADS // 2, 8, "float32", 2)
    geometry = replace(geometry, layer_groups=(0, 1))
    return WorkloadConfig(
        geometry,
        heads,
        scale_for(8, False),
        17,
        variants=(PLAIN, AttentionVariant(window=WINDOW)),
        group_windows=(None, WINDOW),
    )


Workload = tuple[Callable[[Lockstep], None], WorkloadConfig, set[str]]

GROUP_WORKLOADS: dict[str, Workload] = {
    "ReadsGroupZeroTables": (_past_the_window, _config(), {"output"}),
    "DropsReleasedEntries": (_past_the_window, _config(), {"output"}),
    "SlotsOncePerStep": (_past_the_window, _config(), {"K", "V"}),
}
