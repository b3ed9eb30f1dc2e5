"""Benchmark the Triton paged-attention kernel against PyTorch SDPA on the same KV, made contiguous.

Run ``python -m benchmarks.attention`` (``--quick`` for a short run, ``--out
FILE.md`` to save the table). It first checks the kernel against the spec's
float64 reference attention on small batches (every dtype, both the single-pass
and the split-KV path) and stops if that fails. Then, on a GPU, it times with
``triton.testing.do_bench`` (median) decode batches (1..256 sequences, contexts
512..32k, 32 query / 8 KV heads, head dim 128, block 16, fp16 and bf16) and
mixed prefill + decode batches, and reports for each case:

* time, and achieved bandwidth: the bytes of K and V that must be read plus Q
  and O, over the time;
* that bandwidth as a share of the device's copy bandwidth, measured in the same
  run (a device-to-device copy: bytes read + written, over its time);
* the time of the split heuristic's choice and of a forced single pass;
* PyTorch SDPA on the same K and V gathered into contiguous tensors (the
  baseline), the speedup over it, and the largest difference between the two.

On a CPU the kernels run under Triton's interpreter: it runs one tiny case and
says that its figures are not performance figures.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import backend_gpu  # noqa: F401  (interpreter on CPU-only machines, before triton)
from backend_gpu.kernels import choose_num_splits, paged_attention
from benchmarks._batches import context_step
from spec.attention import paged_attention as reference_attention
from spec.block_manager import BlockManager
from spec.kv_budget import cdiv
from spec.kv_memory import KVMemory

__all__ = ["main"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
"""Max abs error vs the float64 reference for the correctness gate (outputs are O(1))."""


@dataclass(frozen=True)
class Shape:
    """Heads and layout of the benchmarked model: Llama-3-8B-like attention."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass(frozen=True)
class Case:
    """One batch: ``(context_before, new_tokens)`` per sequence."""

    name: str
    work: tuple[tuple[int, int], ...]


@dataclass
class Row:
    """One line of the results table (``None``: not measured)."""

    case: str
    dtype: str
    seqs: int
    tokens: int
    max_context: int
    splits: int
    time_us: float | None = None
    single_pass_us: float | None = None
    gbps: float | None = None
    copy_share: float | None = None
    sdpa_us: float | None = None
    max_diff: float | None = None
    note: str = ""


def decode(batch: int, context: int) -> Case:
    return Case(f"decode b={batch} ctx={context}", tuple((context - 1, 1) for _ in range(batch)))


def mixed(prefills: int, chunk: int, prefill_ctx: int, decodes: int, decode_ctx: int) -> Case:
    work = ((prefill_ctx - chunk, chunk),) * prefills + ((decode_ctx - 1, 1),) * decodes
    name = f"mixed {prefills}x{chunk}@{prefill_ctx} + {decodes} dec@{decode_ctx}"
    return Case(name, work)


def gpu_cases(quick: bool) -> list[Case]:
    """Decode sweeps and mixed batches; ``quick`` keeps the headline cases only."""
    if quick:
        return [decode(1, 4096), decode(64, 4096), decode(256, 2048), mixed(2, 512, 2048, 62, 4096)]
    cases = [decode(b, c) for c in (512, 4096, 32768) for b in (1, 4, 16, 64, 256)]
    cases += [decode(b, 8192) for b in (8, 64)]
    cases += [mixed(4, 512, 2048, 60, 4096), mixed(1, 2048, 2048, 127, 2048)]
    return cases


# -- correctness gate ---------------------------------------------------------------------


def check_correctness(device: torch.device) -> list[str]:
    """The kernel against the spec on small mixed batches; returns failures (empty if none)."""
    failures = []
    rng = np.random.default_rng(0)
    configs = [(16, 128, 4), (3, 96, 2), (1, 64, 8)]  # (block size, head dim, GQA ratio)
    if device.type == "cpu":
        configs = [(3, 24, 2)]
    for block_size, head_dim, group in configs:
        work = [(40, 1), (0, 9), (19, 6), (70, 1)]
        num_blocks = sum(cdiv(c + n, block_size) for c, n in work) + 5
        m = BlockManager(num_blocks, block_size)
        held = [m.pool.allocate() for _ in range(num_blocks)]
        for i in rng.permutation(num_blocks):
            m.pool.decref(held[int(i)])
        batch, _ = context_step(m, work)
        for dtype, tdt in DTYPES.items():
            mem = KVMemory(1, num_blocks, block_size, 2, head_dim)
            for seq, (c, n) in enumerate(work):
                kv = torch.randn(2, c + n, 2, head_dim).to(tdt).double().numpy()
                slots = [m.slot(seq, p) for p in range(c + n)]
                mem.write(0, kv[0], kv[1], slots)
            q = torch.randn(batch.num_tokens, 2 * group, head_dim).to(tdt)
            want = reference_attention(q.double().numpy(), batch, mem, 0, 0.1)
            k = torch.from_numpy(mem.k[0]).to(device, tdt)
            v = torch.from_numpy(mem.v[0]).to(device, tdt)
            meta = _metadata(batch.query_start_loc, batch.seq_lens, batch.block_tables, device)
            for splits in (1, 4):
                got = paged_attention(q.to(device), k, v, *meta, 0.1, num_splits=splits)
                err = float(np.abs(got.double().cpu().numpy() - want).max())
                if not err <= TOLERANCE[dtype]:
                    failures.append(
                        f"block {block_size}, head dim {head_dim}, GQA {group}, {dtype}, "
                        f"{splits} splits: max abs error {err:.3g} > {TOLERANCE[dtype]}"
                    )
    return failures


def _metadata(
    starts: Sequence[int],
    lens: Sequence[int],
    tables: Sequence[Sequence[int]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def i32(x: object) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=device)

    return i32(list(starts)), i32(list(lens)), i32([list(t) for t in tables])


# -- timing -------------------------------------------------------------------------------


def time_us(fn: Callable[[], object], device: torch.device, quick: bool) -> float:
    """Median time of ``fn`` in microseconds: do_bench on a GPU, a few wall-clock runs on CPU."""
    if device.type == "cuda":
        import triton.testing

        rep = 40 if quick else 100
        ms = triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")
        return float(ms) * 1e3
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1e6


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written, over the time)."""
    if device.type != "cuda":
        return math.nan
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src), device, quick=False)
    return 2 * n / (t * 1e-6) / 1e9


@dataclass
class Batch:
    """One benchmark batch on the device: paged KV, its contiguous copies, queries, metadata."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    starts: torch.Tensor
    lens: torch.Tensor
    tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    bytes_moved: int


def build(case: Case, shape: Shape, dtype: torch.dtype, device: torch.device) -> Batch:
    """Random K/V in shuffled blocks, random queries, and the batch metadata."""
    b = shape.block_size
    lens = [c + n for c, n in case.work]
    blocks = [-(-n // b) for n in lens]
    total = sum(blocks)
    ids = torch.randperm(total, device=device).to(torch.int32)
    width = max(blocks)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32, device=device)
    offset = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = ids[offset : offset + nb]
        offset += nb
    cache_shape = (total, b, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    starts = [0]
    for _, n in case.work:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    size = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * sum(lens) * shape.num_kv_heads * shape.head_dim * size
    qo_bytes = 2 * q.numel() * size
    return Batch(
        q,
        k_cache,
        v_cache,
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(lens, dtype=torch.int32, device=device),
        tables,
        max(n for _, n in case.work),
        max(lens),
        kv_bytes + qo_bytes,
    )


def run_kernel(batch: Batch, out: torch.Tensor, num_splits: int | None) -> torch.Tensor:
    return paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.starts,
        batch.lens,
        batch.tables,
        1.0 / math.sqrt(batch.q.shape[2]),
        out=out,
        num_splits=num_splits,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        check_indices=False,
    )


# -- SDPA baseline ------------------------------------------------------------------------


def contiguous_kv(batch: Batch, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``seq``'s first ``length`` keys and values as ``[H_kv, length, D]``."""
    b = batch.k_cache.shape[1]
    table = batch.tables[seq, : -(-length // b)].long()
    k = batch.k_cache[table].flatten(0, 1)[:length].transpose(0, 1).contiguous()
    v = batch.v_cache[table].flatten(0, 1)[:length].transpose(0, 1).contiguous()
    return k, v


def sdpa_baseline(batch: Batch, case: Case) -> Callable[[], torch.Tensor]:
    """SDPA over contiguous KV: decodes of one length in one call, each prefill chunk alone.

    GQA without copying K/V: the ``G`` query heads of one KV head become ``G``
    query rows (times the chunk length) of that head, with a causal mask for chunks.
    """
    h_kv, d = batch.k_cache.shape[2], batch.k_cache.shape[3]
    group = batch.q.shape[1] // h_kv
    scale = 1.0 / math.sqrt(d)
    starts = batch.starts.tolist()
    decodes = [i for i, (_, n) in enumerate(case.work) if n == 1]
    dec_len = {sum(case.work[i]) for i in decodes}
    plan: list[Callable[[torch.Tensor], None]] = []
    if decodes and len(dec_len) == 1:
        length = dec_len.pop()
        shape = (len(decodes), h_kv, length, d)
        k = torch.empty(shape, dtype=batch.q.dtype, device=batch.q.device)
        v = torch.empty_like(k)
        for j, i in enumerate(decodes):  # one sequence at a time: peak memory ~ 2x the KV
            k[j], v[j] = contiguous_kv(batch, i, length)
        rows = torch.tensor([starts[i] for i in decodes], device=batch.q.device)

        def run_decodes(out: torch.Tensor) -> None:
            q = batch.q[rows].view(len(decodes), h_kv, group, d)
            o = F.scaled_dot_product_attention(q, k, v, scale=scale)
            out[rows] = o.reshape(len(decodes), h_kv * group, d)

        plan.append(run_decodes)
        decodes_done = set(decodes)
    else:
        decodes_done = set()
    for i, (c, n) in enumerate(case.work):
        if i not in decodes_done:
            plan.append(_sdpa_chunk(batch, i, c, n, group, scale))

    def run() -> torch.Tensor:
        out = torch.empty_like(batch.q)
        for step in plan:
            step(out)
        return out

    return run


def _sdpa_chunk(
    batch: Batch, seq: int, context: int, n: int, group: int, scale: float
) -> Callable[[torch.Tensor], None]:
    k, v = contiguous_kv(batch, seq, context + n)
    h_kv, d = k.shape[0], k.shape[2]
    start = int(batch.starts[seq])
    pos = torch.arange(context, context + n, device=k.device)
    visible = torch.arange(context + n, device=k.device)[None, :] <= pos[:, None]  # [n, L]
    mask = visible.repeat(group, 1)  # rows ordered (head in group, token)

    def step(out: torch.Tensor) -> None:
        q = batch.q[start : start + n].view(n, h_kv, group, d).permute(1, 2, 0, 3)
        o = F.scaled_dot_product_attention(
            q.reshape(h_kv, group * n, d), k, v, attn_mask=mask, scale=scale
        )
        out[start : start + n] = o.view(h_kv, group, n, d).permute(2, 0, 1, 3).reshape(n, -1, d)

    return step


# -- driver -------------------------------------------------------------------------------


def measure(
    case: Case, dtype: str, shape: Shape, device: torch.device, quick: bool, copy_bw: float
) -> Row:
    batch = build(case, shape, DTYPES[dtype], device)
    splits = choose_num_splits(
        len(case.work),
        shape.num_kv_heads,
        shape.num_heads,
        shape.head_dim,
        batch.max_query_len,
        batch.max_seq_len,
        device,
    )
    row = Row(case.name, dtype, len(case.work), batch.q.shape[0], batch.max_seq_len, splits)
    out = torch.empty_like(batch.q)
    row.time_us = time_us(lambda: run_kernel(batch, out, None), device, quick)
    if splits > 1:
        single = torch.empty_like(batch.q)
        row.single_pass_us = time_us(lambda: run_kernel(batch, single, 1), device, quick)
    row.gbps = batch.bytes_moved / (row.time_us * 1e-6) / 1e9
    row.copy_share = None if math.isnan(copy_bw) else row.gbps / copy_bw
    try:
        baseline = sdpa_baseline(batch, case)
        want = baseline()
        row.max_diff = float((out.float() - want.float()).abs().max())
        if not row.max_diff <= TOLERANCE[dtype]:
            row.note = f"MISMATCH vs SDPA (> {TOLERANCE[dtype]})"
        row.sdpa_us = time_us(baseline, device, quick)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # baseline only: report, go on
        row.note = f"SDPA baseline failed: {type(e).__name__}"
    return row


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: Sequence[Row]) -> str:
    head = (
        "| case | dtype | seqs | tokens | max ctx | splits | time (us) | single pass (us) "
        "| GB/s | % of copy BW | SDPA (us) | speedup vs SDPA | max diff vs SDPA | note |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        speed = r.sdpa_us / r.time_us if r.sdpa_us and r.time_us else None
        share = None if r.copy_share is None else 100 * r.copy_share
        lines.append(
            f"| {r.case} | {r.dtype} | {r.seqs} | {r.tokens} | {r.max_context} | {r.splits} "
            f"| {_fmt(r.time_us, '.1f')} | {_fmt(r.single_pass_us, '.1f')} "
            f"| {_fmt(r.gbps, '.0f')} | {_fmt(share, '.1f')} | {_fmt(r.sdpa_us, '.1f')} "
            f"| {_fmt(speed, '.2f')} | {_fmt(r.max_diff, '.2e')} | {r.note} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="headline cases only")
    parser.add_argument("--out", help="also write the markdown report to this file")
    parser.add_argument(
        "--dtypes", default="float16,bfloat16", help="comma-separated (GPU runs only)"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    failures = check_correctness(device)
    if failures:
        print("CORRECTNESS CHECK FAILED; not benchmarking:\n" + "\n".join(failures))
        return 1
    report = [header(device)]
    report.append(
        "Correctness vs the spec's float64 reference: passed (every dtype, 1 and 4 splits)."
    )
    if device.type == "cuda":
        copy_bw = copy_bandwidth(device)
        report.append(f"Measured device copy bandwidth: {copy_bw:.0f} GB/s (read + write).")
        shape, cases, dtypes = Shape(), gpu_cases(args.quick), args.dtypes.split(",")
    else:
        copy_bw = math.nan
        report.append(
            "**CPU run under the Triton interpreter: these figures are NOT performance "
            "figures**; they only show that the script runs. Run it on a GPU to benchmark."
        )
        shape = Shape(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
        cases, dtypes = [decode(2, 64), mixed(1, 8, 16, 1, 64)], ["float16"]
    rows = []
    for case in cases:
        for dtype in dtypes:
            try:
                rows.append(measure(case, dtype, shape, device, args.quick, copy_bw))
            except Exception as e:  # one failed case (OOM, say) must not lose the others
                traceback.print_exc(file=sys.stderr)
                note = (
                    f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                )
                rows.append(Row(case.name, dtype, len(case.work), 0, 0, 0, note=note))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"  done: {case.name} {dtype}", file=sys.stderr, flush=True)
    report += ["", table(rows), "", target_line(rows), ""]
    text = "\n".join(report)
    print(text)
    if args.out:
        from conformance.output_files import write_output  # the one rule for an output path

        write_output(Path(args.out), text)
    return 0


def target_line(rows: Sequence[Row]) -> str:
    """The issue's goal: decode at batch 64, context 4096, at >= 90% of copy bandwidth."""
    hits = [r for r in rows if r.case == "decode b=64 ctx=4096" and r.copy_share is not None]
    if not hits:
        return "Target (decode b=64 ctx=4096 at >= 90% of copy bandwidth): not measured here."
    parts = [f"{r.dtype} {100 * r.copy_share:.1f}%" for r in hits if r.copy_share is not None]
    met = all(r.copy_share is not None and r.copy_share >= 0.9 for r in hits)
    verdict = "met" if met else "NOT met"
    return (
        f"Target (decode b=64 ctx=4096 at >= 90% of copy bandwidth): {', '.join(parts)}: {verdict}."
    )


def header(device: torch.device) -> str:
    import triton

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    return (
        f"# Paged attention benchmark\n\n{when}; device: {name}; torch {torch.__version__}, "
        f"triton {triton.__version__}.\n\nBytes moved = K and V of every context token "
        "(read once) + Q + O; time = median of triton.testing.do_bench. Baseline: "
        "torch SDPA on the same K and V gathered into contiguous tensors (gather not timed). "
        "Times include the Python wrappers' launch cost where it exceeds the GPU time "
        "(tiny batches).\n"
    )


if __name__ == "__main__":
    sys.exit(main())
