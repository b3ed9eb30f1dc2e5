"""Deliberately broken backends: each is the numpy backend with one real bug class planted.

The self-test runs the quick profile against every one and passes only if the
suite catches them all. Each is a bug class that production engines have
shipped or nearly shipped (slot mapping off at a block boundary, padding slot
-1 used as an index, int32 offsets that wrap in large pools, and so on); each
class's docstring says what the suite must do to see it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from numpy.typing import NDArray

from conformance.judges.dtypes import round_to
from conformance.lockstep.numpy_backend import F32, Ints, NumpyPagedBackend
from conformance.planted.groups import PLANTED_GROUPS
from conformance.planted.latent import PLANTED_LATENT
from conformance.planted.speculative import PLANTED_SPECULATIVE
from conformance.planted.variants import (
    AlibiFromKeyZero,
    AlibiSignFlipped,
    CausalOffByOne,
    Fp8NoSaturation,
    Fp8ScaleIgnored,
    Fp8ScaleTwice,
    Fp8Truncates,
    KVScalesSwapped,
    SinkNotInDenominator,
    SoftcapAfterExp,
    SoftcapUnscaled,
    WindowOffByOne,
)
from spec.attention import AttentionVariant
from spec.backend import FloatArray
from spec.batch import BatchMetadata
from spec.block_manager import cdiv
from spec.capabilities import Capabilities, DecodeSplit


class SlotOffByOne(NumpyPagedBackend):
    """The first token of every block is written one slot early (off by one at the boundary)."""

    def _write_slots(self, slots: Ints) -> Ints:
        b = self._geo().block_size
        return np.where((slots > 0) & (slots % b == 0), slots - 1, slots)


class IgnoresBlockTable(NumpyPagedBackend):
    """Attention assumes a sequence's blocks are contiguous from its first block."""

    def _blocks(self, table: Sequence[int], seq_len: int) -> list[int]:
        n = cdiv(seq_len, self._geo().block_size)
        return [(table[0] + i) % self._geo().num_blocks for i in range(n)]


class SkipsCopies(NumpyPagedBackend):
    """Copy-on-write copies are never executed: the writer's new block lacks the prefix."""

    def _copy_block(self, layer: int, src: int, dst: int) -> None:
        pass


class CopiesKeyOnly(NumpyPagedBackend):
    """Copy-on-write copies K but not V."""

    def _copy_block(self, layer: int, src: int, dst: int) -> None:
        self._k[layer][dst] = self._k[layer][src]


class CopiesBackwards(NumpyPagedBackend):
    """Copy-on-write copies ``dst`` onto ``src``: the direction swapped."""

    def _copy_block(self, layer: int, src: int, dst: int) -> None:
        super()._copy_block(layer, dst, src)


class WritesPaddingSlot(NumpyPagedBackend):
    """Slot -1 is used as an index (numpy: the last slot of the pool) instead of skipped."""

    def _written(self, slots: Ints) -> NDArray[np.bool_]:
        return np.ones(slots.shape, dtype=np.bool_)


class WrongGqaMapping(NumpyPagedBackend):
    """Query head ``h`` reads KV head ``h % H_kv`` instead of ``h // (H / H_kv)``."""

    def _kv_head(self, head: int, num_heads: int, num_kv_heads: int) -> int:
        return head % num_kv_heads


class ChunkMaskFromZero(NumpyPagedBackend):
    """A prefill chunk's causal mask assumes the chunk starts at position 0."""

    def _query_positions(self, seq_len: int, query_len: int) -> Ints:
        if query_len == 1:
            return super()._query_positions(seq_len, query_len)
        return np.arange(query_len, dtype=np.int64)


class IgnoresPartialBlock(NumpyPagedBackend):
    """Attention reads only full blocks: the tokens in the last, partial block are lost."""

    def _num_keys(self, seq_len: int) -> int:
        return seq_len - seq_len % self._geo().block_size

    def _blocks(self, table: Sequence[int], seq_len: int) -> list[int]:
        return list(table[: seq_len // self._geo().block_size])


class ReadsPastSeqLen(NumpyPagedBackend):
    """Decode skips the mask ("the query is last anyway") and reads the whole last block."""

    def _num_keys(self, seq_len: int) -> int:
        return cdiv(seq_len, self._geo().block_size) * self._geo().block_size

    def _visible(self, positions: Ints, num_keys: int, seq_len: int) -> NDArray[np.bool_]:
        if positions.size == 1:
            return np.ones((1, num_keys), dtype=np.bool_)
        return super()._visible(positions, num_keys, seq_len)


class MasksByZeroWeight(NumpyPagedBackend):
    """Loads the whole last block, masks the scores past ``seq_len``, and multiplies those
    slots' V by their zero weights: exact while unowned slots hold finite values, NaN once
    one holds NaN or an infinity (``0 * inf``), as freed memory on a GPU may."""

    def _num_keys(self, seq_len: int) -> int:
        return cdiv(seq_len, self._geo().block_size) * self._geo().block_size


class SoftmaxWithoutMax(NumpyPagedBackend):
    """Softmax without subtracting the row maximum, in the cache dtype: fp16 overflows past 11."""

    def _softmax(self, scores: F32) -> F32:
        storage = np.float16 if self._geo().dtype == "float16" else np.float32
        with np.errstate(over="ignore", invalid="ignore"):
            weights = np.exp(scores.astype(storage)).astype(np.float32)
            out: F32 = weights / weights.sum(axis=-1, keepdims=True)
        return out


class IgnoresScale(NumpyPagedBackend):
    """The ``scale`` argument is ignored: always ``1 / sqrt(head_dim)``."""

    def _scale(self, scale: float, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim)


class OnlineSoftmaxNoRescale(NumpyPagedBackend):
    """Online softmax over 64-key tiles that never rescales the accumulator by ``alpha``.

    Exact while a sequence fits one tile (64 keys or fewer): only long contexts show it.
    """

    tile = 64

    def _weighted_sum(self, scores: F32, v: F32) -> F32:
        n = scores.shape[0]
        m = np.full(n, -np.inf, dtype=np.float32)
        total = np.zeros(n, dtype=np.float32)
        acc = np.zeros((n, v.shape[1]), dtype=np.float32)
        for start in range(0, scores.shape[1], self.tile):
            s = scores[:, start : start + self.tile]
            m_new = np.maximum(m, s.max(axis=1))  # key 0 is visible to all: finite from tile 1
            alpha = np.exp(m - m_new)
            p = np.exp(s - m_new[:, None])
            total = total * alpha + p.sum(axis=1)
            acc = acc + p @ v[start : start + self.tile]  # the bug: ``acc * alpha + ...``
            m = m_new
        out: F32 = acc / total[:, None]
        return out


class WrongAtHeadDim128(NumpyPagedBackend):
    """A kernel specialised for head dim 128 walks it in 64-wide tiles and drops the second tile.

    Exact at every other head dim: only a workload at 128 shows it.
    """

    def _dot(self, q: F32, k: F32) -> F32:
        if q.shape[-1] == 128:
            out: F32 = q[:, :64] @ k[:, :64].T
            return out
        return super()._dot(q, k)


class WrongPastFourSequences(NumpyPagedBackend):
    """Block tables are read per tile of 4 sequences: sequence ``i`` uses row ``i % 4``.

    Exact while a batch holds at most 4 sequences.
    """

    def _table(self, batch: BatchMetadata, i: int, group: int) -> Sequence[int]:
        return batch.tables(group)[i % 4]


class PowerOfTwoBlockMath(NumpyPagedBackend):
    """Position -> (table entry, offset) by shift and mask: right only for power-of-two blocks."""

    def _split_position(self, positions: Ints) -> tuple[Ints, Ints]:
        b = self._geo().block_size
        shift = b.bit_length() - 1
        return positions >> shift, positions & (b - 1)


class WrongAtGqaRatio3(NumpyPagedBackend):
    """The ratio-3 kernel instance pads each group of 3 query heads to 4 and maps ``h // 4``.

    Exact at every other ratio, and at ratio 3 with one KV head (heads 0..2 all map to 0).
    """

    def _kv_head(self, head: int, num_heads: int, num_kv_heads: int) -> int:
        if num_heads == 3 * num_kv_heads:
            return min(head // 4, num_kv_heads - 1)
        return super()._kv_head(head, num_heads, num_kv_heads)


class Int32Offsets(NumpyPagedBackend):
    """Element offsets ``block * B * H_kv * D`` computed in int32: they wrap past 2^31.

    Exact on every pool smaller than 2^31 elements per layer.
    """

    def _block_offsets(self, blocks: Ints) -> Ints:
        g = self._geo()
        per_block = np.int32(g.block_size * g.num_kv_heads * g.head_dim)
        with np.errstate(over="ignore"):
            wrapped = blocks.astype(np.int32) * per_block
        return wrapped.astype(np.int64)


class Int32OffsetsInCachedContext(NumpyPagedBackend):
    """Element offsets wrap in int32 only in the loop over a prefill chunk's cached context
    (the keys before the chunk: an earlier chunk or a prefix hit), as a kernel whose
    context loop computes ``block * stride`` in 32 bits while its new-token loop does not.

    Exact on pools under 2^31 elements, and on a large pool whose prompts are prefilled
    whole from position 0: only a chunk after cached context in the far blocks shows it.
    """

    _context = 0  # positions before this one are the current sequence's cached context

    def _query_positions(self, seq_len: int, query_len: int) -> Ints:
        self._context = seq_len - query_len if query_len > 1 else 0
        return super()._query_positions(seq_len, query_len)

    def _gather(
        self, layer: int, table: Sequence[int], seq_len: int, first: int = 0
    ) -> tuple[F32, F32]:
        k, v = super()._gather(layer, table, seq_len, first)
        cached = np.arange(first, min(self._context, k.shape[0]))
        if cached.size == 0:
            return k, v
        g = self._geo()
        row = g.num_kv_heads * g.head_dim
        entry, offset = np.divmod(cached, g.block_size)
        blocks = np.asarray(table, dtype=np.int64)[entry]
        per_block = np.int32(g.block_size * row)
        with np.errstate(over="ignore"):
            wrapped = (blocks.astype(np.int32) * per_block).astype(np.int64)
        index = (wrapped + offset * row)[:, None] + np.arange(row)
        shape = (cached.size, g.num_kv_heads, g.head_dim)
        for cache, out, which in ((self._k[layer], k, 0), (self._v[layer], v, 1)):
            got = cache.reshape(-1)[index % cache.size].reshape(shape).astype(np.float32)
            if g.kv_dtype is not None:
                got = self._dequantize(got, self._kv_scale(layer, which))
            out[cached] = got
        return k, v


class SinksWrongOnSplitKV(NumpyPagedBackend):
    """The split-KV decode path counts the sink once per split (two here) when it merges the
    splits' partial softmaxes; the single pass and prefill are right.

    A decode-only call whose longest visible context reaches 256 keys takes the
    split path, as the project's Triton kernel does under the interpreter's own plan:
    only a layer with sinks decoding a long context shows it. It declares that plan
    (``decode_split``) and names the path each call took (``attention_path()``), as a
    backend without Triton launches to read can: the report's paths are then observed.
    """

    _split = False

    @property
    def capabilities(self) -> Capabilities:
        plan = DecodeSplit(256, 128, 2, note="a numpy model of a split-KV kernel")
        return replace(super().capabilities, decode_split=plan)

    def attention_path(self) -> str:
        return "split-KV decode" if self._split else "single-pass decode"

    def attention(
        self,
        layer: int,
        query: FloatArray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> FloatArray:
        window = None if variant is None else variant.window
        longest = max((n if window is None else min(n, window) for n in batch.seq_lens), default=0)
        self._split = batch.is_decode_only and longest >= 256
        return super().attention(layer, query, batch, scale, variant=variant)

    def _sink_softmax(self, scores: F32, sink: float) -> F32:
        if not self._split:
            return super()._sink_softmax(scores, sink)
        s = np.float32(sink)
        top = np.maximum(scores.max(axis=-1, keepdims=True), s)
        weights = np.exp(scores - top)
        out: F32 = weights / (weights.sum(axis=-1, keepdims=True) + 2 * np.exp(s - top))
        return out


class RoundsTowardZero(NumpyPagedBackend):
    """The output is converted to fp16 or bf16 by truncation (toward zero), not to nearest.

    Every output is within one ulp: inside any tolerance an honest kernel
    needs. Only the bias, half an ulp toward zero on average, shows it.
    """

    def _round_output(self, out: F32) -> F32:
        dtype = self._geo().dtype
        if dtype == "float16":
            near = out.astype(np.float16)
            up = np.abs(near.astype(np.float32)) > np.abs(out)
            toward = np.where(up, np.nextafter(near, np.float16(0)), near)
            result: F32 = toward.astype(np.float32)
            return result
        if dtype == "bfloat16":
            bits = out.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
            truncated: F32 = bits.view(np.float32)
            return truncated
        return out


class Fp16Accumulation(NumpyPagedBackend):
    """``P @ V`` accumulated in the activation dtype (fp16 or bf16), one key at a time.

    Each partial sum is rounded to 11 (or 8) significant bits: the error grows
    with the number of keys, and is a few ulps already at tens of keys.
    """

    def _weighted_sum(self, scores: F32, v: F32) -> F32:
        dtype = self._geo().dtype
        if dtype == "float32":
            return super()._weighted_sum(scores, v)
        p = self._softmax(scores)
        acc = np.zeros((p.shape[0], v.shape[1]), dtype=np.float32)
        for t in range(p.shape[1]):
            acc = round_to(acc + p[:, t : t + 1] * v[t], dtype).astype(np.float32)
        return acc


class ProductsInActivationDtype(NumpyPagedBackend):
    """Each ``q_d * k_d`` rounded to the activation dtype (fp16 or bf16) before the float32 sum.

    A decode kernel that saves registers so (SGLang's fp16 decode kernel did) loses a product's
    low bits: with large logits the scores, and so every weight, move by more than any honest
    kernel's rounding. Correct if declared (``Capabilities(products="activation")``); the
    report names it among its hypotheses when it is not.
    """

    def _dot(self, q: F32, k: F32) -> F32:
        dtype = self._geo().dtype
        if dtype == "float32":
            return super()._dot(q, k)
        products = round_to(q[:, None, :] * k[None, :, :], dtype)  # [n, t, D]
        out: F32 = products.astype(np.float32).sum(axis=-1, dtype=np.float32)
        return out


PLANTED: dict[str, type[NumpyPagedBackend]] = {
    "slot mapping off by one at a block boundary": SlotOffByOne,
    "ignores the block table (assumes contiguous blocks)": IgnoresBlockTable,
    "copy-on-write copy not executed": SkipsCopies,
    "copy-on-write copy executed for K only": CopiesKeyOnly,
    "copy-on-write copy in the wrong direction": CopiesBackwards,
    "padding slot -1 written (into the last slot)": WritesPaddingSlot,
    "GQA head mapping wrong": WrongGqaMapping,
    "causal mask wrong for a prefill chunk that starts mid-sequence": ChunkMaskFromZero,
    "last partial block ignored": IgnoresPartialBlock,
    "stale data read past seq_len": ReadsPastSeqLen,
    "masked slots' V multiplied by a zero weight (NaN with poisoned memory)": MasksByZeroWeight,
    "softmax without max subtraction (overflows in fp16)": SoftmaxWithoutMax,
    "wrong scale": IgnoresScale,
    "online softmax over 64-key tiles without rescaling the accumulator": OnlineSoftmaxNoRescale,
    "wrong only at head dim 128 (second 64-wide tile dropped)": WrongAtHeadDim128,
    "wrong only past 4 sequences in a batch (table row i % 4)": WrongPastFourSequences,
    "position to block by shift and mask (wrong for non-power-of-two blocks)": PowerOfTwoBlockMath,
    "wrong only at GQA ratio 3 (heads padded to 4)": WrongAtGqaRatio3,
    "element offsets computed in int32 (wrap past 2^31)": Int32Offsets,
    "output rounded toward zero": RoundsTowardZero,
    "int32 offsets only in the cached-context loop": Int32OffsetsInCachedContext,
    "sinks counted once per split on the split-KV decode path": SinksWrongOnSplitKV,
    "P @ V accumulated in fp16": Fp16Accumulation,
    "q.k products rounded to fp16 before the sum (undeclared)": ProductsInActivationDtype,
    "sliding window edge off by one (w + 1 keys)": WindowOffByOne,
    "soft-cap applied to the unscaled scores": SoftcapUnscaled,
    "soft-cap applied after exp": SoftcapAfterExp,
    "attention sink left out of the softmax denominator": SinkNotInDenominator,
    "ALiBi bias with the sign flipped": AlibiSignFlipped,
    "fp8 KV scale applied twice": Fp8ScaleTwice,
    "fp8 KV scale not applied": Fp8ScaleIgnored,
    "fp8 KV write without saturation (overflow to NaN/inf)": Fp8NoSaturation,
    "causal mask off by one (a prefill query sees the next token)": CausalOffByOne,
    "fp8 K and V scales swapped in attention": KVScalesSwapped,
    "fp8 KV write truncates the quotient (rounds toward zero)": Fp8Truncates,
    "ALiBi measured from key 0 (only a sink shows it)": AlibiFromKeyZero,
    **PLANTED_GROUPS,
    **PLANTED_SPECULATIVE,
    **PLANTED_LATENT,
}
"""Each planted bug, by the bug class it stands for."""
