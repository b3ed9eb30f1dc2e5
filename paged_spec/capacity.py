"""How many sequences fit: contiguous max-length reservation against paging.

Run ``python -m paged_spec.capacity`` for two worked examples, or pick a
preset and override any number (``--help``). The arithmetic is
:mod:`spec.kv_budget`'s; this module adds model presets, a device budget and a
report. For a model with more than one kind of memory (a fixed per-sequence
state, sliding-window layers) the report also runs the spec's own allocator,
:class:`spec.cache_manager.CacheManager` over the model's KV cache groups,
admitting sequences until one does not fit (:mod:`paged_spec._capacity_alloc`).

A Llama-3.1-8B-class model costs 128 KiB of KV per token, and a 200-token
request inside a 4,096-token contiguous reservation wastes over 95% of it:

>>> r = capacity(PRESETS["llama-3.1-8b"], context=200, max_len=4096, pool_bytes=512 * MIB)
>>> r.kv_bytes_per_token // KIB, round(r.contiguous_waste, 4)
(128, 0.9512)
>>> r.contiguous_fit, r.paged_fit        # 512 MiB: one 512 MiB reservation, or 19 such requests
(1, 19)

A hybrid 27B example: 64 KiB per token over its 16 full-attention
layers, 16 GiB at the full 262,144-token context; the 23,859 MiB pool holds one
maximum reservation but ten 32,768-token sessions of 2,192 MiB (2 GiB of KV plus
144 MiB of fixed state):

>>> r = capacity(PRESETS["hybrid-27b"])
>>> r.kv_bytes_per_token // KIB, r.max_len * r.kv_bytes_per_token // GIB
(64, 16)
>>> r.paged_seq_bytes // MIB, r.contiguous_fit, r.paged_fit
(2192, 1, 10)

The spec's allocator agrees: a state pool of one slot and 23,715 blocks holds
one maximum reservation; ten slots and 22,419 blocks hold ten sessions.

>>> [(f.sequences, f.state_slots, f.blocks) for f in allocator_fits(PRESETS["hybrid-27b"])]
[(1, 1, 23715), (10, 10, 22419)]

A Gemma-style model (5 sliding-window layers of 1,024 tokens per global
layer) fits many more sequences once its windows release their blocks:

>>> gemma = PRESETS["gemma-style"]
>>> allocator_fits(gemma)[-1].sequences, windowless_fit(gemma).sequences
(18, 4)

A DeepSeek-V3-shaped model keeps latent KV (multi-head latent attention): one
row of 512 + 64 values a token and layer, 68.6 KiB a token in bfloat16, where
the same 61 layers with grouped heads of 128 (the model's head width) need
244 KiB with 8 KV heads and 3.8 MiB with a KV head for each of its 128 query
heads. On 90% of an 80 GB or a 141 GB device (weights elsewhere):

>>> [(c.label, c.bytes_per_token, c.tokens) for c in latent_comparison(PRESETS["deepseek-v3"])]
... # doctest: +NORMALIZE_WHITESPACE
[('latent 512 + 64', 70272, (1024576, 1805824)),
 ('grouped, 8 KV heads x 128', 249856, (288128, 507840)),
 ('multi-head, 128 KV heads x 128', 3997696, (17984, 31680))]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from paged_spec._capacity_alloc import AllocatorFit, ModelKV, allocator_fit, group_layout
from paged_spec._cli import (
    fraction,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)
from spec.errors import SpecError
from spec.kv_budget import (
    GIB,
    KIB,
    MIB,
    contiguous_waste_fraction,
    sequence_bytes,
    sequences_that_fit,
)

__all__ = [
    "COMPARED_DEVICES_GB",
    "COMPARED_LAYOUTS",
    "PRESETS",
    "Capacity",
    "LayoutCost",
    "ModelKV",
    "allocator_fits",
    "capacity",
    "format_bytes",
    "latent_comparison",
    "latent_lines",
    "main",
    "mib",
    "preset_pool_origin",
    "report",
    "windowless_fit",
]


# An H200 (141 GB) at 90% memory utilization, less 16 GB of bf16 weights.
_H200_GB, _H200_UTILIZATION = 141, 0.9
_8B_WEIGHTS = 16 * 10**9
_H200_8B_POOL = int(_H200_GB * 1e9 * _H200_UTILIZATION) - _8B_WEIGHTS

PRESETS: dict[str, ModelKV] = {
    "llama-3.1-8b": ModelKV(
        "llama-3.1-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2,
        context=200, max_len=4096, pool_bytes=_H200_8B_POOL, weights_bytes=_8B_WEIGHTS,
    ),
    "hybrid-27b": ModelKV(
        "hybrid-27b", num_layers=16, num_kv_heads=4, head_dim=256, dtype_bytes=2,
        state_bytes=144 * MIB, context=32_768, max_len=262_144, pool_bytes=23_859 * MIB,
        weights_bytes=54 * 10**9, state_layers=48,
    ),
    "gemma-style": ModelKV(
        "gemma-style", num_layers=48, num_kv_heads=4, head_dim=128, dtype_bytes=2,
        context=16_384, max_len=65_536, pool_bytes=6 * GIB, weights_bytes=24 * 10**9,
        window_layers=40, window=1024,
    ),
    "deepseek-v3": ModelKV(
        "deepseek-v3", num_layers=61, num_kv_heads=1, head_dim=576, dtype_bytes=2,
        latent_dim=512, context=32_768, max_len=131_072, block_size=64,
        pool_bytes=int(_H200_GB * 1e9 * _H200_UTILIZATION),
    ),
}  # fmt: skip
"""The worked examples' models, with weights (16 GB and 54 GB in bf16), and a windowed one.

The 27B's 4 KV heads x 256 is one split of its 64 KiB per token; its preset pool
is 23,859 MiB, what an 80 GB device leaves after the weights and a
runtime reserve. ``--device-gb`` recomputes the pool from the preset's weights.
``gemma-style`` is illustrative, not a published model: Gemma 3's pattern of
five 1,024-token sliding-window layers per global layer, on 48 layers of 4 KV
heads x 128 in bf16, with a 6 GiB pool. ``deepseek-v3`` is DeepSeek-V3's KV
geometry (61 layers of latent rows, ``kv_lora_rank`` 512 + ``qk_rope_head_dim``
64, bf16, FlashMLA's blocks of 64 tokens) on 90% of an H200, weights not
counted: its 671B parameters span several devices, and each device of a
data-parallel attention deployment holds the whole latent cache of its own
sequences (``--weights-gb`` takes off this device's share of the weights).
"""

COMPARED_LAYOUTS = (("grouped", 8, 128), ("multi-head", 128, 128))
"""The grouped-heads layouts a latent model is priced against, ``(kind, KV heads, head dim)``:
heads as wide as DeepSeek-V3's value heads (128, also the non-rotary part of its query and
key heads), eight of them as grouped-query attention has, or one for each of its 128 query
heads (see :func:`latent_comparison`)."""
COMPARED_DEVICES_GB = (80, 141)
"""The devices :func:`latent_comparison` fills: an 80 GB one (H100, A100) and an H200."""

DEFAULT_MODELS = ("llama-3.1-8b", "hybrid-27b")
"""What ``python -m paged_spec.capacity`` prints with no ``--model``: the two worked examples."""


@dataclass(frozen=True)
class Capacity:
    """What a pool holds for one model: per token, per block, per sequence, sequences."""

    model: str
    block_size: int
    context: int
    max_len: int
    pool_bytes: int
    kv_bytes_per_token: int
    bytes_per_block: int
    pool_blocks: int
    contiguous_seq_bytes: int
    paged_seq_bytes: int
    contiguous_fit: int
    paged_fit: int
    contiguous_waste: float  # share of a max reservation a ``context`` sequence leaves empty

    @property
    def gain(self) -> float:
        """How many times more sequences paging fits."""
        return self.paged_fit / self.contiguous_fit if self.contiguous_fit else float("inf")


def capacity(
    model: ModelKV,
    *,
    context: int | None = None,
    max_len: int | None = None,
    pool_bytes: int | None = None,
    block_size: int | None = None,
) -> Capacity:
    """Size ``model``'s pool; any keyword overrides the preset's scenario."""
    m = replace(
        model,
        context=model.context if context is None else context,
        max_len=model.max_len if max_len is None else max_len,
        pool_bytes=model.pool_bytes if pool_bytes is None else pool_bytes,
        block_size=model.block_size if block_size is None else block_size,
    )
    if not 1 <= m.context <= m.max_len:
        raise ValueError(f"context must be in 1..max_len ({m.max_len}), got {m.context}")
    if m.pool_bytes < 0:
        raise ValueError(f"pool_bytes must be >= 0, got {m.pool_bytes}")
    per_token = m.bytes_per_token()
    contiguous = sequence_bytes(m.max_len, per_token, state_bytes=m.state_bytes)
    paged = sequence_bytes(m.context, per_token, block_size=m.block_size, state_bytes=m.state_bytes)
    return Capacity(
        model=m.name,
        block_size=m.block_size,
        context=m.context,
        max_len=m.max_len,
        pool_bytes=m.pool_bytes,
        kv_bytes_per_token=per_token,
        bytes_per_block=per_token * m.block_size,
        pool_blocks=m.pool_bytes // (per_token * m.block_size),
        contiguous_seq_bytes=contiguous,
        paged_seq_bytes=paged,
        contiguous_fit=sequences_that_fit(m.pool_bytes, contiguous),
        paged_fit=sequences_that_fit(m.pool_bytes, paged),
        contiguous_waste=contiguous_waste_fraction(m.context, m.max_len),
    )


@dataclass(frozen=True)
class LayoutCost:
    """One KV layout of a model: its bytes a token, and the tokens that fit on each of
    :data:`COMPARED_DEVICES_GB` (whole blocks of the model's block size)."""

    label: str
    bytes_per_token: int
    tokens: tuple[int, ...]


def latent_comparison(
    model: ModelKV, *, utilization: float = _H200_UTILIZATION, weights_bytes: int = 0
) -> list[LayoutCost]:
    """A latent model beside the same layers with grouped heads, on 80 GB and 141 GB devices.

    The grouped layouts are those DeepSeek-V2's paper prices multi-head latent
    attention against: K and V heads of the model's head width (128), with 8 KV
    heads (grouped-query attention, as Llama 3 70B groups its query heads) and
    with one KV head for each of the 128 query heads (multi-head attention; its
    keys' 64 rotary values, which the expanded form adds, are left out, so this
    is a lower bound). Each device's pool is ``utilization`` of it less
    ``weights_bytes``.
    """
    if model.latent_dim is None:
        raise ValueError(f"{model.name} is not a latent model (no latent_dim)")
    layouts = [
        (f"latent {model.latent_dim} + {model.head_dim - model.latent_dim}", model),
        *(
            (f"{kind}, {heads} KV heads x {dim}", replace(
                model, num_kv_heads=heads, head_dim=dim, latent_dim=None
            ))
            for kind, heads, dim in COMPARED_LAYOUTS
        ),
    ]  # fmt: skip
    out = []
    for label, m in layouts:
        per_block = m.bytes_per_token() * m.block_size
        pools = [int(gb * 1e9 * utilization) - weights_bytes for gb in COMPARED_DEVICES_GB]
        tokens = tuple(max(0, pool) // per_block * m.block_size for pool in pools)
        out.append(LayoutCost(label, m.bytes_per_token(), tokens))
    return out


def allocator_fits(model: ModelKV) -> list[AllocatorFit]:
    """The spec's allocator at ``context`` tokens, after ``max_len`` (a reservation's worth,
    whose sequences the state pool limits) when the model has a fixed-size state."""
    lengths = (model.max_len, model.context) if model.state_bytes else (model.context,)
    return [allocator_fit(model, n) for n in lengths]


def windowless_fit(model: ModelKV) -> AllocatorFit:
    """The spec's allocator at ``context`` tokens with every window keeping all its blocks."""
    return allocator_fit(model, model.context, release=False)


def format_bytes(n: int) -> str:
    """``n`` bytes in a binary unit a reader can take in at a glance.

    An exact count of the largest unit that divides ``n`` when it has at most
    five digits ("23,859 MiB"); otherwise two decimals of the largest
    unit that fits, so a pool never reads as "54,687,500 KiB".

    >>> format_bytes(128 * KIB), format_bytes(2192 * MIB), format_bytes(16 * GIB)
    ('128 KiB', '2,192 MiB', '16 GiB')
    >>> format_bytes(54_687_500 * KIB), format_bytes(1536 * MIB + 1), format_bytes(100)
    ('52.15 GiB', '1.50 GiB', '100 B')
    """
    units = [("GiB", GIB), ("MiB", MIB), ("KiB", KIB)]
    for name, size in units:
        if n >= size and n % size == 0 and n // size < 100_000:
            return f"{n // size:,} {name}"
    for name, size in units:
        if n >= size:
            return f"{n / size:,.2f} {name}"
    return f"{n:,} B"


def mib(n: int) -> str:
    """``n`` bytes in MiB, the unit of every byte column of the report.

    >>> mib(2192 * MIB), mib(MIB // 2), mib(int(110.9e9))
    ('2,192', '0.50', '105,762')
    """
    if n % MIB == 0 or n >= 1000 * MIB:
        return f"{round(n / MIB):,}"
    return f"{n / MIB:,.2f}"


def preset_pool_origin(name: str) -> str:
    """Where a preset's pool comes from: a device budget, or a figure the preset gives."""
    return {
        "llama-3.1-8b": _device_origin(_H200_GB, _H200_UTILIZATION, _8B_WEIGHTS),
        "hybrid-27b": "the preset, an 80 GB device less 54 GB of weights and a runtime reserve",
        "gemma-style": "the preset, an illustrative 6 GiB",
        "deepseek-v3": (
            f"{_H200_GB:g} GB device x {_H200_UTILIZATION:g} utilization, weights not counted "
            "(this device's share: --weights-gb)"
        ),
    }.get(name, "the preset")


def _device_origin(device_gb: float, utilization: float, weights_bytes: int) -> str:
    return (
        f"{device_gb:g} GB device x {utilization:g} utilization"
        f" - {weights_bytes / 1e9:g} GB of weights"
    )


Row = tuple[str, str, str, str]  # label, MiB a sequence, sequences that fit, note


def _allocator_rows(model: ModelKV) -> list[Row]:
    """The spec allocator's rows: each scenario's fit and how the pools were split."""
    rows: list[Row] = []
    fits = allocator_fits(model)
    for fit in fits:
        pools = f"{fit.blocks:,} blocks of {format_bytes(fit.block_bytes)}"
        if fit.state_slots:
            slots = "slot" if fit.state_slots == 1 else "slots"
            pools = f"{fit.state_slots:,} state {slots} + {pools}"
        rows.append((f"allocator, {fit.context:,} tokens", "", f"{fit.sequences:,}", pools))
    if model.window_layers:
        whole = windowless_fit(model)
        gain = f"{fits[-1].sequences / whole.sequences:.1f}x" if whole.sequences else "all"
        rows.append(("windows kept whole", "", f"{whole.sequences:,}", f"releasing fits {gain}"))
    return rows


def report(
    c: Capacity,
    model: ModelKV | None = None,
    pool_origin: str = "",
    *,
    utilization: float = _H200_UTILIZATION,
) -> str:
    """The human-readable report ``python -m paged_spec.capacity`` prints.

    Two lines of geometry and budget (the pool, and ``pool_origin``: where it
    comes from), then one table whose columns each keep one unit: MiB a
    sequence, and sequences. With ``model`` (a hybrid or windowed one), the
    spec allocator's rows follow the formula's; with a latent one, the
    comparison with grouped heads (:func:`latent_comparison`, at
    ``utilization`` of each device, less the model's weights).
    """
    head = [
        f"== {c.model}: {format_bytes(c.kv_bytes_per_token)} of KV a token,"
        f" {format_bytes(c.bytes_per_block)} a block of {c.block_size} tokens",
        f"pool: {mib(c.pool_bytes)} MiB = {c.pool_blocks:,} blocks",
        *([f"pool from: {pool_origin}"] if pool_origin else []),
    ]
    gain = f"{c.gain:.1f}x" if c.contiguous_fit else ""
    rows: list[Row] = [
        ("", "MiB a sequence", "sequences", ""),
        (
            f"contiguous, reserve {c.max_len:,}",
            mib(c.contiguous_seq_bytes),
            f"{c.contiguous_fit:,}",
            "",
        ),
        (
            f"paged, context {c.context:,}",
            mib(c.paged_seq_bytes),
            f"{c.paged_fit:,}",
            gain,
        ),
    ]
    if model is not None and model.has_groups:
        rows += _allocator_rows(model)
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    table = [f"{a:<{w[0]}}  {b:>{w[1]}}  {n:>{w[2]}}  {note}".rstrip() for a, b, n, note in rows]
    tail = [
        f"a {c.context:,}-token sequence leaves {c.contiguous_waste:.1%} of a"
        f" {c.max_len:,}-token reservation empty"
    ]
    if model is not None and model.has_groups:
        tail.append(f"KV cache groups: {group_layout(model).describe(model)}")
    if model is not None and model.latent_dim is not None:
        tail += ["", *latent_lines(model, utilization)]
    return "\n".join([*head, "", *table, "", *tail])


def latent_lines(model: ModelKV, utilization: float = _H200_UTILIZATION) -> list[str]:
    """:func:`latent_comparison` as a table: bytes a token, and tokens each device holds."""
    weights = model.weights_bytes
    costs = latent_comparison(model, utilization=utilization, weights_bytes=weights)
    where = f"{utilization:g} of a device"
    if weights:
        where += f" less {weights / 1e9:g} GB of weights"
    header = ("", "KV a token", *(f"tokens, {gb} GB" for gb in COMPARED_DEVICES_GB))
    rows = [header] + [
        (c.label, format_bytes(c.bytes_per_token), *(f"{t:,}" for t in c.tokens)) for c in costs
    ]
    w = [max(len(r[i]) for r in rows) for i in range(len(header))]
    table = [
        "  ".join([r[0].ljust(w[0]), *(x.rjust(n) for x, n in zip(r[1:], w[1:], strict=True))])
        for r in rows
    ]
    return [
        f"beside grouped heads on the same layers; tokens in {where}:",
        *table,
    ]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m paged_spec.capacity", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", choices=sorted(PRESETS), action="append", help="preset (repeatable)")
    p.add_argument("--layers", type=positive_int, help="layers that cache K/V")
    p.add_argument("--kv-heads", type=positive_int)
    p.add_argument("--head-dim", type=positive_int, help="a latent model's: its row width")
    p.add_argument(
        "--latent-dim", type=positive_int, help="latent (MLA) rows: their c_kv part; 1 KV head"
    )
    p.add_argument("--dtype-bytes", type=positive_int, help="2 for bf16/fp16, 1 for fp8")
    p.add_argument("--state-mib", type=nonnegative_float, help="fixed per-sequence state, MiB")
    p.add_argument("--context", type=positive_int, help="tokens a sequence actually holds")
    p.add_argument("--max-len", type=positive_int, help="tokens a contiguous allocator reserves")
    p.add_argument("--block-size", type=positive_int)
    p.add_argument("--window", type=positive_int, help="sliding window of the windowed layers")
    p.add_argument("--window-layers", type=nonnegative_int, help="layers with a sliding window")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--pool-mib", type=nonnegative_float, help="KV pool size, MiB")
    budget.add_argument(
        "--device-gb",
        type=positive_float,
        help="device memory, GB; the pool is device x --utilization - weights",
    )
    p.add_argument(
        "--weights-gb", type=nonnegative_float, help="weights, GB (default: the preset's)"
    )
    p.add_argument("--utilization", type=fraction, default=0.9, help="share of the device used")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _pick(value: int | None, default: int) -> int:
    return default if value is None else value


def _pool_from_device(base: ModelKV, a: argparse.Namespace) -> int:
    weights = base.weights_bytes if a.weights_gb is None else int(a.weights_gb * 1e9)
    pool = int(a.device_gb * 1e9 * a.utilization) - weights
    if pool < 0:
        raise ValueError(
            f"{base.name}: {a.device_gb:g} GB x utilization {a.utilization:g} leaves less than "
            f"the {weights / 1e9:g} GB of weights"
        )
    return pool


def _pool_origin(base: ModelKV, a: argparse.Namespace) -> str:
    """Where the pool of ``base`` under these arguments comes from, in words."""
    if a.pool_mib is not None:
        return f"--pool-mib {a.pool_mib:g}"
    if a.device_gb is not None:
        weights = base.weights_bytes if a.weights_gb is None else int(a.weights_gb * 1e9)
        return _device_origin(a.device_gb, a.utilization, weights)
    return preset_pool_origin(base.name)


def _model_from_args(base: ModelKV, a: argparse.Namespace) -> ModelKV:
    pool = base.pool_bytes
    if a.pool_mib is not None:
        pool = int(a.pool_mib * MIB)
    elif a.device_gb is not None:
        pool = _pool_from_device(base, a)
    state = base.state_bytes if a.state_mib is None else int(a.state_mib * MIB)
    window_layers = _pick(a.window_layers, base.window_layers)
    window = base.window if a.window is None else a.window
    if window_layers and window is None:
        raise ValueError(f"{base.name}: --window-layers {window_layers} needs a --window")
    return replace(
        base,
        window_layers=window_layers,
        window=window if window_layers else None,
        num_layers=_pick(a.layers, base.num_layers),
        num_kv_heads=_pick(a.kv_heads, base.num_kv_heads),
        head_dim=_pick(a.head_dim, base.head_dim),
        latent_dim=base.latent_dim if a.latent_dim is None else a.latent_dim,
        weights_bytes=base.weights_bytes if a.weights_gb is None else int(a.weights_gb * 1e9),
        dtype_bytes=_pick(a.dtype_bytes, base.dtype_bytes),
        state_bytes=state,
        context=_pick(a.context, base.context),
        max_len=_pick(a.max_len, base.max_len),
        block_size=_pick(a.block_size, base.block_size),
        pool_bytes=pool,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Print the capacity of each chosen preset (default: every preset)."""
    args = _parser().parse_args(argv)
    try:
        names = args.model or DEFAULT_MODELS
        models = [_model_from_args(PRESETS[name], args) for name in names]
        results = [(m, capacity(m)) for m in models]
        if args.json:
            print(json.dumps([_json(m, r, args.utilization) for m, r in results], indent=2))
        else:
            origins = [_pool_origin(PRESETS[name], args) for name in names]
            texts = [
                report(r, m, o, utilization=args.utilization)
                for (m, r), o in zip(results, origins, strict=True)
            ]
            print("\n\n".join(texts))
    except (ValueError, SpecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _json(model: ModelKV, r: Capacity, utilization: float) -> dict[str, object]:
    out: dict[str, object] = asdict(r) | {"gain": r.gain}
    if model.latent_dim is not None:
        costs = latent_comparison(model, utilization=utilization, weights_bytes=model.weights_bytes)
        out["layouts"] = {
            "devices_gb": list(COMPARED_DEVICES_GB),
            "rows": [asdict(c) for c in costs],
        }
    if model.has_groups:
        fits = [asdict(f) for f in allocator_fits(model)]
        out["allocator"] = {"groups": group_layout(model).describe(model), "fits": fits}
        if model.window_layers:
            out["allocator"] |= {"windows_kept_whole": asdict(windowless_fit(model))}  # type: ignore[operator]
    return out


if __name__ == "__main__":
    sys.exit(main())
