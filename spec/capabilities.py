"""What a backend declares it can run: the envelope the conformance suite draws within.

What a backend can run is declared, not discovered: its :class:`Capabilities`
(:attr:`spec.backend.Backend.capabilities`). The conformance suite draws only
what is declared and lists the rest as skipped; it asks
:meth:`Capabilities.unsupported` of a geometry, and
:meth:`Capabilities.batch_unsupported` of each batch, before calling the
backend with it. Everything new in a contract revision is off by default, so
a backend written against an earlier revision keeps working unchanged.

>>> from spec.kv_geometry import KVGeometry
>>> caps = Capabilities("mine", dtypes={"float16"}, head_dims={64, 128})
>>> caps.unsupported(KVGeometry(1, 8, 16, num_kv_heads=2, head_dim=96), num_heads=4)
['dtype float32', 'head dim 96']

A backend runs the latent layout (multi-head latent attention) only where it says so:

>>> mla = KVGeometry(1, 8, 16, num_kv_heads=1, head_dim=576, dtype="float16", latent_dim=512)
>>> caps.unsupported(mla, num_heads=128)
['latent layout 512+64']
>>> Capabilities("mla", dtypes={"float16"}, latent={(512, 64)}).unsupported(mla, num_heads=128)
[]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, fields

from spec.attention import VARIANTS, AttentionVariant
from spec.batch import BatchMetadata
from spec.errors import ArgumentTypeError, ArgumentValueError
from spec.kv_geometry import DTYPES, KV_DTYPES, KVGeometry
from spec.validate import check_bool, check_choice, check_positive

TENSOR_KINDS = ("numpy", "torch")
"""How arrays cross the boundary: numpy on the host (the default), or torch tensors on the
backend's device (the device-resident contract: see :class:`spec.backend.Backend`)."""


PRODUCTS = ("exact", "tf32", "activation", "fp8", "normalised")
"""How a backend's attention rounds its products, as it may declare (:attr:`Capabilities.products`).

* ``exact``: every product exact and summed in float32 (a float32 ``tl.dot``
  with ``input_precision="ieee"``; float16 and bfloat16 operands, whose
  products float32 holds exactly).
* ``tf32``: float32 products on TF32 operands (Q, K, P and V with 10 mantissa
  bits), as a float32 ``tl.dot`` at its default precision computes on NVIDIA
  GPUs (vLLM's Triton attention does); float16 and bfloat16 unchanged.
* ``activation``: each ``q_d * k_d`` rounded to the activation dtype before
  the float32 sum (a float16 decode kernel that saves registers so); float32
  unchanged.
* ``fp8``: Q and the probabilities cast to the cache's fp8 dtype before the
  products (an fp8 cache's tensor-core path); unquantized caches unchanged.
* ``normalised``: the probabilities divided by their sum first, then rounded
  to the activation dtype before ``P @ V`` (an eager softmax followed by a
  matrix product, as PyTorch's FlexAttention runs on a CPU); float32 unchanged.

The suite judges a backend beside a same-precision reference that rounds as
declared, and says so; undeclared, such a kernel fails, with the rounding
named among the report's hypotheses.
"""


@dataclass(frozen=True)
class DecodeSplit:
    """When a backend's decode splits its keys into parts (split-KV, flash-decoding), as its
    launch plan decides: declared so that the suite can reach each part of the plan.

    * ``min_keys``: a decode-only call of one sequence whose visible context
      (its keys, or its window's) reaches this many keys is split into two
      parts or more; a decode of fewer keys never is.
    * ``part_keys``: a part holds at most about this many keys when programs
      are few, so a lone decode of ``k`` keys runs ``ceil(k / part_keys)``
      parts, up to ``max_parts``.
    * ``note``: the plan in a few words, as reports quote it.

    >>> DecodeSplit(1024, 512, 64).parts_at(4097)
    9
    """

    min_keys: int  # a lone decode of this many visible keys or more is split
    part_keys: int  # keys a part holds at most, when programs are few
    max_parts: int  # parts a decode is split into at most
    note: str = ""  # the plan in a few words (the target, its program budget)

    def __post_init__(self) -> None:
        for name in ("min_keys", "part_keys", "max_parts"):
            check_positive(f"capabilities.decode_split.{name}", getattr(self, name))
        if self.max_parts < 2:
            raise ArgumentValueError(
                f"capabilities.decode_split.max_parts is {self.max_parts}: a split has 2 parts "
                "or more (declare decode_split=None for a kernel that never splits)"
            )
        if not isinstance(self.note, str):
            raise ArgumentTypeError(f"capabilities.decode_split.note must be a str: {self.note!r}")

    def parts_at(self, keys: int) -> int:
        """Parts of a lone decode of ``keys`` visible keys (1: a single pass)."""
        if keys < self.min_keys:
            return 1
        return max(2, min(self.max_parts, -(-keys // self.part_keys)))

    def keys_for(self, parts: int) -> int:
        """The fewest visible keys of a lone decode split into ``parts`` parts or more."""
        assert 2 <= parts <= self.max_parts, "a split into more parts than the plan allows"
        return max(self.min_keys, (parts - 1) * self.part_keys + 1)

    def describe(self) -> str:
        """The plan in words: ``splits a decode from 1,024 keys, 512 keys a part, up to 64``."""
        words = (
            f"splits a decode from {self.min_keys:,} keys, {self.part_keys:,} keys a part, "
            f"up to {self.max_parts} parts"
        )
        return f"{words} ({self.note})" if self.note else words


Excludes = Callable[[KVGeometry, int, AttentionVariant | None], str | None]
"""A backend's own rule for combinations it cannot run: geometry, query heads and a layer's
variant in, the reason out (``None`` when it can run them)."""


def _names(label: str, values: Iterable[str], known: Sequence[str]) -> frozenset[str]:
    out = frozenset(values)
    unknown = sorted(out - set(known))
    if unknown:
        raise ArgumentValueError(f"capabilities.{label}: unknown {unknown}; known: {list(known)}")
    return out


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports. The conformance suite skips, and reports, the rest.

    ``None`` for a set or a limit means "any value". Sets are stored as frozensets.

    * Numbers: ``dtypes`` (activation dtypes), ``kv_dtypes`` (quantized caches).
    * Shapes: ``block_sizes``, ``head_dims``, ``num_kv_heads``, ``gqa_ratios``
      (query heads per KV head), ``max_gqa_ratio``.
    * Batches: ``max_num_seqs`` per call; ``max_query_len`` (1 for a
      decode-only kernel); ``max_context_len`` (``seq_len``); ``decode``
      (one new token after cached context); ``chunked_prefill`` (several new
      tokens after cached context); ``mixed_batches`` (single- and multi-token
      queries in one call).
    * Memory: ``copy_on_write`` (fork rules), ``prefix_caching`` (prefix hits),
      ``kv_groups`` (layers in several KV cache groups, one table each).
    * ``speculative``: multi-token decode rows (:mod:`spec.speculative`): the
      last verified token and ``k`` drafts after cached context, causal among
      themselves, whose rejected K/V stays in the cache past ``seq_len`` after
      a rollback and must never be read. The suite drafts ``k <=
      max_query_len - 1`` tokens, and only when ``chunked_prefill`` is true
      too (a row of ``1 + k`` tokens after context is that kind of query).
    * Attention: ``variants``, a subset of :data:`spec.attention.VARIANTS`.
    * ``latent``: the latent layout of multi-head latent attention
      (:attr:`KVGeometry.latent_dim <spec.kv_geometry.KVGeometry>`), as the
      ``(latent_dim, rope_dim)`` pairs it runs (``{(512, 64)}`` for
      DeepSeek-V3's); empty (the default): none; ``None``: any. For a latent
      geometry this set is the shape declaration: ``head_dims``,
      ``num_kv_heads``, ``gqa_ratios`` and ``max_gqa_ratio`` describe the
      ordinary layout and are not consulted (``excludes`` can veto more).
    * ``products``: how attention rounds its products, one of :data:`PRODUCTS`
      (``"exact"``, the default; ``"tf32"``; ``"activation"``; ``"fp8"``). A
      declaration that contradicts the dtypes (``tf32`` without float32,
      ``activation`` or ``normalised`` with float32 alone, ``fp8`` without an fp8 cache)
      is refused.
    * ``decode_split``: when the kernel splits a decode's keys into parts
      (:class:`DecodeSplit`), so that the suite draws decodes that reach every
      part of the plan (``None``: not declared; the suite then draws by its own
      guess, and reports what it observes).
    * ``tensors``: ``"numpy"`` (the default contract) or ``"torch"``.
    * ``table_width``: block tables at least this many entries wide, as an
      engine's persistent table is (``None``: exactly as wide as the batch's
      longest row). The extra entries are padding (:data:`spec.batch.PAD_BLOCK`)
      and :data:`spec.batch.PADDING_RULE` governs them like any padding.
    * ``excludes``: the backend's own veto for combinations the fields above
      cannot say (a head dim only in some dtypes, say).
    """

    name: str  # how reports name the backend
    device: str = "cpu"  # where its arrays live ("cpu", "cuda", ...)
    dtypes: AbstractSet[str] = frozenset(DTYPES)  # activation dtypes it runs
    kv_dtypes: AbstractSet[str] = frozenset()  # quantized KV dtypes it stores (empty: none)
    block_sizes: AbstractSet[int] | None = None  # None: any
    head_dims: AbstractSet[int] | None = None  # None: any
    num_kv_heads: AbstractSet[int] | None = None  # None: any
    gqa_ratios: AbstractSet[int] | None = None  # query heads per KV head; None: any
    max_gqa_ratio: int | None = None  # None: no limit
    max_num_seqs: int | None = None  # sequences in one call; None: no limit
    max_query_len: int | None = None  # new tokens of one sequence; 1: decode-only
    max_context_len: int | None = None  # ``seq_len`` of one sequence; None: no limit
    decode: bool = True  # one new token after cached context
    chunked_prefill: bool = True  # several new tokens after cached context
    mixed_batches: bool = True  # single- and multi-token queries in one call
    copy_on_write: bool = True  # the fork rules: shared blocks, the step's copies
    prefix_caching: bool = True  # sequences that start on prefix-cache hits
    kv_groups: bool = False  # layers in several KV cache groups, one table each
    speculative: bool = True  # multi-token decode rows (1 + k tokens), rolled back after
    variants: AbstractSet[str] = frozenset()  # of spec.attention.VARIANTS
    latent: AbstractSet[tuple[int, int]] | None = frozenset()  # (latent, rope) pairs; None: any
    products: str = "exact"  # how attention rounds its products: one of PRODUCTS
    decode_split: DecodeSplit | None = None  # when a decode splits its keys; None: undeclared
    tensors: str = "numpy"  # "numpy" (the default contract) or "torch"
    table_width: int | None = None  # block tables padded to at least this width; None: exact
    excludes: Excludes | None = field(default=None, compare=False, repr=False)  # its own veto

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ArgumentTypeError(f"capabilities.name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.device, str):
            raise ArgumentTypeError(f"capabilities.device must be a str, got {self.device!r}")
        put = object.__setattr__  # frozen: normalise in place, once
        put(self, "dtypes", _names("dtypes", self.dtypes, DTYPES))
        put(self, "kv_dtypes", _names("kv_dtypes", self.kv_dtypes, KV_DTYPES))
        put(self, "variants", _names("variants", self.variants, VARIANTS))
        for name in ("block_sizes", "head_dims", "num_kv_heads", "gqa_ratios"):
            values = getattr(self, name)
            if values is not None:
                put(
                    self, name, frozenset(check_positive(f"capabilities.{name}", v) for v in values)
                )
        if self.latent is not None:
            put(self, "latent", frozenset(_latent_pair(i, p) for i, p in enumerate(self.latent)))
        for name in (
            "max_gqa_ratio",
            "max_num_seqs",
            "max_query_len",
            "max_context_len",
            "table_width",
        ):
            if getattr(self, name) is not None:
                check_positive(f"capabilities.{name}", getattr(self, name))
        for f in fields(self):
            if f.type == "bool":
                check_bool(f"capabilities.{f.name}", getattr(self, f.name))
        check_choice("capabilities.tensors", self.tensors, TENSOR_KINDS)
        check_choice("capabilities.products", self.products, PRODUCTS)
        contradiction = _products_contradict(self.products, self.dtypes, self.kv_dtypes)
        if contradiction:
            raise ArgumentValueError(f"capabilities.products={self.products!r} {contradiction}")
        if self.decode_split is not None and not isinstance(self.decode_split, DecodeSplit):
            raise ArgumentTypeError(
                "capabilities.decode_split must be a DecodeSplit or None, got "
                f"{self.decode_split!r}"
            )
        if self.excludes is not None and not callable(self.excludes):
            raise ArgumentTypeError("capabilities.excludes must be callable or None")

    def unsupported(
        self, geometry: KVGeometry, num_heads: int, variant: AttentionVariant | None = None
    ) -> list[str]:
        """Why this backend cannot run ``geometry`` with ``num_heads`` query heads; [] if it can."""
        g = geometry
        ratio = num_heads // g.num_kv_heads
        checks = [
            (g.dtype in self.dtypes, f"dtype {g.dtype}"),
            (g.kv_dtype is None or g.kv_dtype in self.kv_dtypes, f"KV dtype {g.kv_dtype}"),
            (_allows(self.block_sizes, g.block_size), f"block size {g.block_size}"),
        ]
        if g.latent_dim is None:
            checks += [
                (_allows(self.head_dims, g.head_dim), f"head dim {g.head_dim}"),
                (_allows(self.num_kv_heads, g.num_kv_heads), f"{g.num_kv_heads} KV heads"),
                (_allows(self.gqa_ratios, ratio), f"GQA ratio {ratio}"),
                (self.max_gqa_ratio is None or ratio <= self.max_gqa_ratio, f"GQA ratio {ratio}"),
            ]
        else:
            pair = (g.latent_dim, g.head_dim - g.latent_dim)
            ok = self.latent is None or pair in self.latent
            checks.append((ok, f"latent layout {pair[0]}+{pair[1]}"))
        checks.append((g.num_groups == 1 or self.kv_groups, f"{g.num_groups} KV cache groups"))
        if variant is not None:
            for name in sorted(variant.features - self.variants):
                checks.append((False, f"attention variant {name}"))
        reasons = list(dict.fromkeys(why for ok, why in checks if not ok))
        if not reasons and self.excludes is not None:
            veto = self.excludes(geometry, num_heads, variant)
            if veto:
                reasons.append(str(veto))
        return reasons

    def query_unsupported(self, query_len: int, context_len: int) -> str | None:
        """Why one sequence's query (``query_len`` new tokens after ``context_len``) cannot run."""
        if self.max_query_len is not None and query_len > self.max_query_len:
            return f"a query of {query_len} tokens (max_query_len {self.max_query_len})"
        seq_len = query_len + context_len
        if self.max_context_len is not None and seq_len > self.max_context_len:
            return f"a context of {seq_len} tokens (max_context_len {self.max_context_len})"
        if context_len and query_len == 1 and not self.decode:
            return "a decode (decode is False)"
        if context_len and query_len > 1 and not self.chunked_prefill:
            return "a prefill chunk after cached context (chunked_prefill is False)"
        return None

    def batch_unsupported(self, batch: BatchMetadata) -> str | None:
        """Why this backend cannot run ``batch`` in one call; ``None`` when it can."""
        if self.max_num_seqs is not None and batch.num_seqs > self.max_num_seqs:
            return f"{batch.num_seqs} sequences in one call (max_num_seqs {self.max_num_seqs})"
        lens = [batch.query_len(i) for i in range(batch.num_seqs)]
        if not self.mixed_batches and lens and min(lens) == 1 < max(lens):
            return "single- and multi-token queries in one call (mixed_batches is False)"
        for i, n in enumerate(lens):
            why = self.query_unsupported(n, batch.seq_lens[i] - n)
            if why:
                return why
        return None


def _latent_pair(i: int, pair: object) -> tuple[int, int]:
    """One declared ``(latent_dim, rope_dim)`` pair: two positive ints."""
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise ArgumentTypeError(
            f"capabilities.latent[{i}] must be a (latent_dim, rope_dim) tuple, got {pair!r}"
        )
    latent = check_positive(f"capabilities.latent[{i}][0]", pair[0])
    return latent, check_positive(f"capabilities.latent[{i}][1]", pair[1])


def _products_contradict(
    products: str, dtypes: AbstractSet[str], kv_dtypes: AbstractSet[str]
) -> str | None:
    """Why a product declaration cannot apply to anything the backend runs; ``None`` if it can.

    >>> _products_contradict("tf32", frozenset({"float16"}), frozenset())
    'rounds float32 products, but float32 is not among the dtypes'
    """
    if products == "tf32" and "float32" not in dtypes:
        return "rounds float32 products, but float32 is not among the dtypes"
    if products in ("activation", "normalised") and not dtypes - {"float32"}:
        return "rounds to a float16 or bfloat16 activation, but no such dtype is declared"
    if products == "fp8" and not kv_dtypes:
        return "casts to the fp8 cache dtype, but no kv_dtypes are declared"
    return None


def _allows(declared: AbstractSet[int] | None, value: int) -> bool:
    return declared is None or value in declared
