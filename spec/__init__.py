"""An executable specification of PagedAttention and continuous batching.

Read the modules in this order. Two support every other and come first:
:mod:`spec.errors` (what misuse raises; every failed operation changes
nothing) and :mod:`spec.validate` (the one place arguments are checked). Then
the first says why, and each later one imports only modules listed before it:

1. :mod:`spec.kv_budget` - why: the KV cache is dynamic memory, and reserving wastes it.
2. :mod:`spec.block_pool` - physical blocks, a free list, reference counts.
3. :mod:`spec.block_table` - block tables, the paging formula, the sliding window.
4. :mod:`spec.prefix_cache` - naming a full block by its chained hash.
5. :mod:`spec.prefix_hits` - a new prompt shares the cached blocks of its prefix.
6. :mod:`spec.block_invariants` - what every rule of the block manager keeps true.
7. :mod:`spec.block_manager` - growth, fork, copy-on-write, drafts: the block manager.
8. :mod:`spec.kv_groups` - KV cache groups: full attention, sliding window, fixed-size state.
9. :mod:`spec.batch` - one step flattened into the metadata kernels consume.
10. :mod:`spec.quant` - fp8 KV: what a quantized cache stores.
11. :mod:`spec.kv_memory` - KV memory in the paged layout; gather through a table.
12. :mod:`spec.attention` - the definition: one sequence's attention, and its variants.
13. :mod:`spec.precision` - how a lower-precision kernel computes it (the suite's emulation).
14. :mod:`spec.attention_batched` - the same, many decodes at once: the suite's tool.
15. :mod:`spec.kv_geometry` - the shape of a KV cache, and the dtypes by name.
16. :mod:`spec.capabilities` - what a backend declares it can run.
17. :mod:`spec.backend` - the contract any backend implements.
18. :mod:`spec.request` - requests and their lifecycle.
19. :mod:`spec.swap` - the host pool that preemption by swapping uses.
20. :mod:`spec.host_memory` - where a swapped-out sequence's memory waits.
21. :mod:`spec.metrics` - what a serving operator watches.
22. :mod:`spec.sched_policy` - the scheduler's knobs, and the rank that orders sequences.
23. :mod:`spec.sched_queue` - queues ordered by that rank.
24. :mod:`spec.cache_step` - the memory side of a running sequence's step.
25. :mod:`spec.cache_manager` - the memory side: one query and one command per decision.
26. :mod:`spec.speculative` - speculative decoding: lookahead slots, verification, rollback.
27. :mod:`spec.sched_types` - what a step decides, and the scheduler protocol.
28. :mod:`spec.sched_requests` - the scheduler's ledger of requests and their samples.
29. :mod:`spec.sched_continuous` - continuous batching: admit, run, finish every step.
30. :mod:`spec.sched_static` - the static baseline.
31. :mod:`spec.scheduler` - the lesson of the scheduler and its public names (its
    docstring reads well first; its code only gathers 22-30).

numpy is needed only by 10-17 (fp8, KV memory, attention, the backend contract) and by
:meth:`spec.batch.BatchMetadata.arrays`: the block pool, the prefix cache, the block
manager, the batch layout and the scheduler import and run without it, as on the sandbox
page, which runs them in the reader's browser. So the names below that live in 10-17 are
imported when first used (``from spec import KVMemory`` works as ever).
"""

import importlib
from typing import TYPE_CHECKING

from spec.batch import PAD_BLOCK, BatchMetadata, build_batch
from spec.block_manager import PAD_SLOT, BlockManager
from spec.block_pool import BlockPool
from spec.errors import (
    CapacityError,
    DoubleFreeError,
    DuplicateSequenceError,
    InvalidRequestError,
    OutOfBlocksError,
    SpecError,
    SpeculationError,
    UnknownBlockError,
    UnknownSequenceError,
)

_NUMPY_NAMES = {  # public name -> the module that holds it and needs numpy
    "paged_attention": "spec.attention",
    "Backend": "spec.backend",
    "ReferenceBackend": "spec.backend",
    "Capabilities": "spec.capabilities",
    "KVGeometry": "spec.kv_geometry",
    "KVMemory": "spec.kv_memory",
}

if TYPE_CHECKING:  # the checker sees plain imports; at run time they wait for first use
    from spec.attention import paged_attention
    from spec.backend import Backend, ReferenceBackend
    from spec.capabilities import Capabilities
    from spec.kv_geometry import KVGeometry
    from spec.kv_memory import KVMemory
else:

    def __getattr__(name: str) -> object:
        """A name of ``_NUMPY_NAMES``, imported from its module now and kept (PEP 562)."""
        if name not in _NUMPY_NAMES:
            raise AttributeError(f"module 'spec' has no attribute {name!r}")
        value = getattr(importlib.import_module(_NUMPY_NAMES[name]), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(_NUMPY_NAMES))


__all__ = [
    "PAD_BLOCK",
    "PAD_SLOT",
    "Backend",
    "BatchMetadata",
    "BlockManager",
    "BlockPool",
    "Capabilities",
    "CapacityError",
    "DoubleFreeError",
    "DuplicateSequenceError",
    "InvalidRequestError",
    "KVGeometry",
    "KVMemory",
    "OutOfBlocksError",
    "ReferenceBackend",
    "SpecError",
    "SpeculationError",
    "UnknownBlockError",
    "UnknownSequenceError",
    "build_batch",
    "paged_attention",
]
