"""The workload envelope: the shapes, batch widths and context lengths the suite may draw.

Production kernels run head dims 64, 128, 80, 96, 112 and 256, block sizes of
16, 32 or 64 (and odd ones such as 48, from hybrid models' page alignment),
grouped-query ratios up to 8 (3, 5 and 7 included), batches of tens to
hundreds of sequences and pools whose element offsets pass 2^31. The
envelope is all of that plus the small shapes that failures shrink to. A
backend's declared :class:`~spec.capabilities.Capabilities` are intersected with
it (:mod:`conformance.lockstep.plan`).

There are two envelopes, chosen by ``capabilities.device``:

* **cpu** (the Triton interpreter, numpy and torch backends on a host): every
  head dim, block size and GQA ratio of the envelope, 1 to 3 KV heads, at
  most 3 KV heads x layers in a short example, 2 in wide, large-pool and
  production examples and one KV head in long ones (each KV head of each
  layer costs an interpreted program per sequence and query tile: a quick
  run stays near two minutes), wide batches of 16 to 32 sequences,
  long prompts of 300 to 1100 tokens, and three production shapes run in
  full: head dim 128 with 8 query heads on 2 KV heads and blocks of 16, head
  dim 96 with a GQA ratio of 3 and blocks of 48, and DeepSeek-V3's latent
  rows of 512 + 64 under 128 query heads (on a GPU's plan, 8 programs of 16
  heads a token: every head tile runs), blocks of 16 and two sequences to
  start with (each of its query tokens costs eight interpreted programs);
* **device** (anything else, "cuda:0" say): every shape, 1 to 8 KV heads and
  1 to 4 layers without a cost bound, wide batches of 64 to 256 sequences,
  long prompts of 2048 to 32768 tokens, and production shapes of head dim
  128 with 32 query heads on 8 KV heads.

Both draw the latent layout of multi-head latent attention (one row
``[c_kv, k_rope]`` a token, :mod:`spec.kv_memory`) for a backend that declares
it: ``latent_dim + rope_dim`` of 32 + 16 and 16 + 16 (a row of 48 or 32, as
cheap to interpret as a small head dim: one KV head, every query head sharing
its tile) under 1 to 16 query heads on the CPU, and on a device DeepSeek-V3's
512 + 64 too, with up to 128 query heads; both run 512 + 64 with 128 query
heads as a production shape (blocks of 64 on a device, as FlashMLA pages it).

Each tuple is in shrinking order: its first value is where a failing example
shrinks to (block size 4 rather than 1: the smallest block in which a
partial block differs from a full one).

>>> envelope_for("cpu").wide_seqs, envelope_for("cuda:0").wide_seqs
((16, 24, 32), (64, 128, 256))
>>> for s in envelope_for("cpu").production:
...     print(s.describe())
head dim 128, 8/2 heads, block size 16
head dim 96, 6/2 heads, block size 48
latent 512+64, 128 query heads, block size 16
>>> envelope_for("cpu").latent, envelope_for("cuda:0").production[-1].describe()
(((32, 16), (16, 16)), 'latent 512+64, 128 query heads, block size 64')
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.lockstep.workload import LONG_CONTEXT_SLOTS, LONG_PROMPTS

HEAD_DIMS = (8, 16, 32, 64, 128, 80, 96, 112, 256)
"""Small head dims for shrinking, then the production ones."""
BLOCK_SIZES = (4, 1, 3, 8, 16, 32, 48, 64)
KV_HEADS = (1, 2, 3, 4, 5, 6, 7, 8)
GQA_RATIOS = (1, 2, 3, 4, 5, 6, 7, 8)
LAYERS = (1, 2, 3, 4)
LATENT_LAYOUTS = ((32, 16), (16, 16), (512, 64))
"""Latent layouts ``(latent_dim, rope_dim)``: small ones for shrinking (c_kv and k_rope of
different widths first), then DeepSeek-V2/V3's."""
LATENT_HEADS = (2, 1, 4, 8, 16, 32, 128)
"""Query heads sharing a latent row: two first (one hides a row read per head), up to
DeepSeek-V3's 128 (16 on each of 8 tensor-parallel ranks)."""


@dataclass(frozen=True)
class Shape:
    """One production shape: head dim, KV heads, query heads per KV head, block size."""

    head_dim: int
    num_kv_heads: int
    gqa_ratio: int
    block_size: int
    latent_dim: int | None = None  # a latent layout: rows of head_dim, c_kv latent_dim wide
    width: int | None = None  # sequences an example starts with (None: the envelope's widest)

    def describe(self) -> str:
        heads = self.num_kv_heads * self.gqa_ratio
        if self.latent_dim is not None:
            rope = self.head_dim - self.latent_dim
            return (
                f"latent {self.latent_dim}+{rope}, {heads} query heads, "
                f"block size {self.block_size}"
            )
        return (
            f"head dim {self.head_dim}, {heads}/{self.num_kv_heads} heads, "
            f"block size {self.block_size}"
        )


@dataclass(frozen=True)
class Envelope:
    """What the suite may draw on one kind of device (before the backend's capabilities)."""

    device: str  # "cpu" or "device"
    head_dims: tuple[int, ...]
    block_sizes: tuple[int, ...]
    kv_heads: tuple[int, ...]
    gqa_ratios: tuple[int, ...]
    layers: tuple[int, ...]
    max_kv_heads_x_layers: int | None  # cost bound of a short example (None: unbounded)
    short_seqs: int  # live sequences at most in a short example
    wide_seqs: tuple[int, ...]  # live sequences of a wide example (the first is the shrink target)
    wide_kv_heads_x_layers: int | None  # the bound of the other passes' examples
    long_kv_heads: int | None  # KV heads of a long example at most (None: as wide ones)
    long_prompts: tuple[int, int]  # shortest and longest long prompt
    long_lengths: tuple[int, ...]  # long prompt lengths drawn often: just past switch points
    long_chunks: tuple[int, ...]  # prefill chunk sizes of a long prompt
    long_pool_tokens: int  # pool of a long-context example, in tokens
    production: tuple[Shape, ...]  # shapes run in full, one pass each
    latent: tuple[tuple[int, int], ...] = ()  # latent layouts (latent_dim, rope_dim) drawn
    latent_heads: tuple[int, ...] = (1,)  # query heads of a latent example

    def bound(self, kind: str) -> int | None:
        """The cost bound (KV heads x layers) of one kind of example, ``None`` for none."""
        if kind == "short":
            return self.max_kv_heads_x_layers
        if kind in ("long", "split") and self.long_kv_heads is not None:
            return self.long_kv_heads
        return self.wide_kv_heads_x_layers

    def kv_heads_for(self, kind: str, declared: tuple[int, ...]) -> tuple[int, ...]:
        """The KV head counts an example of ``kind`` may draw (the smallest if none fits).

        >>> envelope_for("cpu").kv_heads_for("wide", (1, 2, 3, 4))
        (1, 2)
        """
        bound = self.bound(kind)
        return tuple(k for k in declared if bound is None or k <= bound) or declared[:1]

    def layers_for(self, kind: str, num_kv_heads: int) -> tuple[int, ...]:
        """The layer counts an example with ``num_kv_heads`` may have under the cost bound.

        >>> envelope_for("cpu").layers_for("short", 3), envelope_for("cpu").layers_for("wide", 2)
        ((1,), (1,))
        """
        if kind in ("long", "split", "large pool", "production"):
            return self.layers[:1]  # long prompts, large pools and full shapes cost per layer
        bound = self.bound(kind)
        if bound is None:
            return self.layers
        return tuple(n for n in self.layers if n * num_kv_heads <= bound) or self.layers[:1]


CPU = Envelope(
    device="cpu",
    head_dims=HEAD_DIMS,
    block_sizes=BLOCK_SIZES,
    kv_heads=KV_HEADS[:3],
    gqa_ratios=GQA_RATIOS,
    layers=LAYERS,
    max_kv_heads_x_layers=3,
    short_seqs=4,
    wide_seqs=(16, 24, 32),
    wide_kv_heads_x_layers=2,
    long_kv_heads=1,
    long_prompts=LONG_PROMPTS,
    long_lengths=(300, 1100, 1025, 513),
    long_chunks=(256, 128, 512, 1024),
    long_pool_tokens=LONG_CONTEXT_SLOTS,
    production=(Shape(128, 2, 4, 16), Shape(96, 2, 3, 48), Shape(576, 1, 128, 16, 512, width=2)),
    latent=LATENT_LAYOUTS[:2],
    latent_heads=LATENT_HEADS[:5],
)

DEVICE = Envelope(
    device="device",
    head_dims=HEAD_DIMS,
    block_sizes=BLOCK_SIZES,
    kv_heads=KV_HEADS,
    gqa_ratios=GQA_RATIOS,
    layers=LAYERS,
    max_kv_heads_x_layers=None,
    short_seqs=8,
    wide_seqs=(64, 128, 256),
    wide_kv_heads_x_layers=None,
    long_kv_heads=None,
    long_prompts=(2048, 32768),
    long_lengths=(2048, 32768, 16385, 8193, 4097),
    long_chunks=(2048, 1024, 4096, 8192),
    long_pool_tokens=65536 + 4096,
    production=(Shape(128, 8, 4, 16), Shape(96, 8, 3, 48), Shape(576, 1, 128, 64, 512)),
    latent=LATENT_LAYOUTS,
    latent_heads=LATENT_HEADS,
)


def envelope_for(device: str) -> Envelope:
    """The envelope for a backend on ``device`` (``capabilities.device``)."""
    return CPU if device == "cpu" else DEVICE
