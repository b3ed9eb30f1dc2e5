"""The torch and Triton backends under speculative decoding: multi-token decode rows, rollback.

Each case runs one lockstep story on a backend and on :class:`ReferenceBackend`, laid
out by the spec's :class:`~spec.cache_manager.CacheManager` with a full-attention layer
and a sliding-window layer (its own KV cache group):

1. prefill a speculating sequence and a plain one;
2. a speculative step: the last verified token and ``k`` drafts (one row of ``1 + k``
   query tokens, causal among themselves, straddling a block boundary), beside a
   plain decode row. The rejected drafts' keys are made huge (and their values far
   off), so that any later query that saw one would be visibly wrong;
3. verification of ``a`` drafts: blocks holding only rejected tokens go back to the
   pool, and the kept last block still holds rejected K/V past the sequence's length;
4. the next step, with fewer drafts: it overwrites some rejected slots and must see
   none of the rest.

Every step compares attention with the float64 reference, token by token, and the
whole cache bit for bit. Block sizes 1, 3, 4 and 16; windows whose edge falls inside
the drafts. Triton runs interpreted on a CPU, so its cases are few and tiny.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from backend_helpers import assert_attention_close, assert_cache_equal

from spec.attention import AttentionVariant, attend
from spec.backend import Backend, KVGeometry, ReferenceBackend
from spec.batch import BatchMetadata
from spec.cache_manager import FULL_ATTENTION, CacheManager, sliding_window


def _torch() -> Backend:
    from devices import DEVICE

    from backend_gpu.torch_backend import TorchBackend

    return TorchBackend(DEVICE)


def _triton() -> Backend:
    from devices import DEVICE

    from backend_gpu.triton_backend import TritonBackend

    return TritonBackend(DEVICE)


HEADS, KV_HEADS, DIM = 2, 1, 4
SPEC, PLAIN = 0, 1  # the speculating sequence and a plain decoding one


class Lockstep:
    """A backend and the reference fed the same steps; every output and the caches compared."""

    def __init__(self, backend: Backend, block_size: int, window: int, seed: int) -> None:
        self.b = block_size
        self.cache = CacheManager(64, block_size, groups=(FULL_ATTENTION, sliding_window(window)))
        geometry = KVGeometry(2, 64, block_size, KV_HEADS, DIM, layer_groups=(0, 1))
        self.variants = [None, AttentionVariant(window=window)]
        self.pair = (backend, ReferenceBackend())
        for x in self.pair:
            x.create_cache(geometry)
        self.rng = np.random.default_rng(seed)

    def run(self, rows: list[tuple[int, int]], loud: dict[int, int] | None = None) -> None:
        """Lay out ``rows``, write new K/V (rows from ``loud[seq]`` on made huge), compare."""
        batch = self.cache.layout(rows)
        for x in self.pair:
            x.copy_blocks(batch.copies)
        t = batch.num_tokens
        for layer in range(2):
            k = self.rng.standard_normal((t, KV_HEADS, DIM)).astype(np.float32)
            v = self.rng.standard_normal((t, KV_HEADS, DIM)).astype(np.float32)
            q = self.rng.standard_normal((t, HEADS, DIM)).astype(np.float32)
            for i, s in enumerate(batch.seq_ids):
                if loud and s in loud:
                    first = batch.query_start_loc[i] + loud[s]
                    end = batch.query_start_loc[i + 1]
                    k[first:end] *= 25.0
                    v[first:end] += 100.0
            outs: list[np.ndarray] = []
            for x in self.pair:
                x.write_kv(layer, k, v, batch.slots(layer))
                kw = {} if self.variants[layer] is None else {"variant": self.variants[layer]}
                outs.append(np.asarray(x.attention(layer, q, batch, 0.5, **kw), dtype=np.float64))
            assert_attention_close(outs[0], outs[1], "float32", batch, layer, _where(batch))
            got, want = (x.read_cache(layer) for x in self.pair)
            for name, g, w in zip("KV", got, want, strict=True):
                assert_cache_equal(g, w, name, layer, _where(batch))


def _where(batch: BatchMetadata) -> str:
    return f"rows {list(zip(batch.seq_ids, batch.seq_lens, strict=True))} (seq, seq_len)"


def _story(
    make: Callable[[], Backend], block_size: int, k: int, accepted: int, window: int
) -> Lockstep:
    """Steps 1-4 of the module docstring; the drafts of step 2 straddle a block boundary."""
    run = Lockstep(make(), block_size, window, seed=block_size * 100 + k * 10 + accepted)
    context = 2 * block_size - 1 if block_size > 1 else 3  # the verified token ends a block
    run.cache.admit(SPEC, [1] * context, chunk_limit=context)
    run.cache.admit(PLAIN, [2] * 3, chunk_limit=3)
    run.run([(SPEC, context), (PLAIN, 3)])
    run.cache.grow(SPEC, [1] * (1 + k), num_draft=k)  # positions context .. context + k
    run.cache.grow(PLAIN, [2])
    held = run.cache.pool.num_held
    run.run([(SPEC, 1 + k), (PLAIN, 1)], loud={SPEC: 1 + accepted})
    rejected = run.cache.verify(SPEC, accepted)
    assert len(rejected) == k - accepted
    kept = context + 1 + accepted
    assert run.cache.manager.num_tokens(SPEC) == kept
    assert run.cache.pool.num_held <= held
    later = max(0, min(1, k - accepted - 1))  # fewer drafts: some rejected slots stay past the end
    run.cache.grow(SPEC, [1] * (1 + later), num_draft=later)
    run.cache.grow(PLAIN, [2])
    run.run([(SPEC, 1 + later), (PLAIN, 1)])
    if later:
        run.cache.rollback(SPEC)  # after the step ran: the verified token's KV stays
    run.cache.grow(SPEC, [1])
    run.cache.grow(PLAIN, [2])
    run.run([(SPEC, 1), (PLAIN, 1)])  # a plain decode after it all
    run.cache.check_integrity()
    return run


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize(("k", "accepted"), [(3, 0), (3, 1), (4, 4), (2, 1)])
def test_torch_runs_multi_token_decode_rows_and_honours_rollback(
    block_size: int, k: int, accepted: int
) -> None:
    _story(_torch, block_size, k, accepted, window=2)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("window", [1, 3, 64])
def test_torch_windows_whose_edge_falls_inside_the_drafts(block_size: int, window: int) -> None:
    _story(_torch, block_size, 4, 1, window)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_triton_runs_multi_token_decode_rows_and_honours_rollback(block_size: int) -> None:
    _story(_triton, block_size, 3, 1, window=2)


class _ReadsOnePast(ReferenceBackend):
    """A planted bug: decode rows mask keys by ``k <= seq_len``, one key too many where the
    last block has room (the key there is rejected K/V after a rollback, or stale)."""

    def attention(
        self,
        layer: int,
        query: np.ndarray,
        batch: BatchMetadata,
        scale: float,
        *,
        variant: AttentionVariant | None = None,
    ) -> np.ndarray:
        out = np.array(super().attention(layer, query, batch, scale, variant=variant))
        group, v = self._geo().group_of(layer), variant or AttentionVariant()
        for i in range(batch.num_seqs):
            n, row = batch.seq_lens[i], batch.query_start_loc[i]
            if batch.query_len(i) > 1 or batch.used_blocks(i) * batch.block_size <= n:
                continue
            first = v.first_visible(n)
            k, val = self._mem().gather(layer, batch.tables(group)[i], n + 1, start=first)
            q = np.asarray(query[row : row + 1], dtype=np.float64)
            pos = np.array([n], dtype=np.int64)
            out[row] = attend(q, k, val, pos, scale, v, first_key=first)[0]
        return out


def test_rejected_kv_lies_past_the_end_in_a_kept_block() -> None:
    """The story leaves rejected K/V where a sloppy kernel would read it: past ``seq_len`` in
    the last block the sequence still holds (so the comparisons above are not vacuous)."""
    run = Lockstep(_torch(), 16, 64, seed=0)
    run.cache.admit(SPEC, [1] * 31, chunk_limit=31)
    run.run([(SPEC, 31)])
    run.cache.grow(SPEC, [1] * 4, num_draft=3)  # positions 31..34 straddle 32
    run.run([(SPEC, 4)], loud={SPEC: 2})
    rejected = run.cache.verify(SPEC, 1)  # keeps 33 tokens
    last = run.cache.manager.block_table(SPEC)[-1]
    assert rejected and all(slot // 16 == last for slot in rejected)


def test_a_kernel_that_reads_one_key_past_seq_len_is_caught() -> None:
    with pytest.raises(AssertionError, match="values off"):
        _story(_ReadsOnePast, 16, 3, 1, window=64)
