"""An executable specification of PagedAttention and continuous batching.

Read the modules in this order: the first says why; each later one builds on those before it.

1. :mod:`spec.kv_budget` - why: the KV cache is dynamic memory, and reserving wastes it.
2. :mod:`spec.errors` - what misuse raises; every failed operation changes nothing.
3. :mod:`spec.block_pool` - physical blocks, a free list, reference counts.
4. :mod:`spec.prefix_cache` - naming a full block by its chained hash.
5. :mod:`spec.block_manager` - block tables, growth, fork, copy-on-write, prefix hits.
6. :mod:`spec.kv_memory` - KV memory in the paged layout; gather through a table.
7. :mod:`spec.batch` - one step flattened into the metadata kernels consume.
8. :mod:`spec.attention` - reference paged attention in float64.
9. :mod:`spec.backend` - the contract any backend implements.
10. :mod:`spec.request` - requests and their lifecycle.
11. :mod:`spec.scheduler` - continuous batching: admit, run, finish every step.
12. :mod:`spec.swap` - the host pool that preemption by swapping uses.
13. :mod:`spec.metrics` - what a serving operator watches.
"""

from spec.attention import paged_attention
from spec.backend import Backend, Capabilities, KVGeometry, ReferenceBackend
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
    UnknownBlockError,
    UnknownSequenceError,
)
from spec.kv_memory import KVMemory

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
    "UnknownBlockError",
    "UnknownSequenceError",
    "build_batch",
    "paged_attention",
]
