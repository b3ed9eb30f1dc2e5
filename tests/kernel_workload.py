"""One fixed workload through every kernel, to compare two ways of running the same kernels.

:func:`outputs` runs it on a device and returns every result as CPU tensors: KV writes
into an fp16 cache and into both fp8 formats (values whose quotient by the scale sits on
or next to an fp8 rounding tie, subnormals, saturating values; one scale a power of two,
one not), a block copy, and attention in each activation dtype, single pass and split,
plain and with every variant, over an fp8 cache too. Everything is drawn from seeded CPU
generators and converted on the CPU (NaN's bytes included), so two processes on two
devices build the same inputs. Run as a script it computes the results with the kernels
interpreted on the CPU and saves them (``torch.save``) to the path given: the interpreted
side of ``tests/test_gpu_compiled.py``.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from backend_helpers import TORCH_DTYPES, make_scenario

from backend_gpu.dtypes import FP8_TORCH
from backend_gpu.kernels import copy_blocks, paged_attention, reshape_and_cache
from spec.quant import FP8_FORMATS

WORK = [(40, 1), (0, 9), (23, 4), (70, 1)]
"""Long decodes, a prefill, a chunk after context: several key tiles, and splits."""
FP8_SCALES = {"fp8_e4m3": (1 / 64, 3 / 448), "fp8_e5m2": (2.0**-10, 3 / 57344)}
"""(k_scale, v_scale): K's a power of two (exact ties), V's not (the division rounds)."""
EXACT = ("kv_write", "block_copy")
"""Result names that must agree bit for bit however the kernels run; the rest is attention."""


def _near_ties(fmt: str, rows: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, 2, 16]`` values of fp8 midpoints, their float32 neighbours, the values
    themselves, subnormals and values past the largest, with random signs (unscaled)."""
    codes = torch.arange(128, dtype=torch.uint8).view(FP8_TORCH[fmt]).double().numpy()
    points = codes[np.isfinite(codes)]  # 0 and every positive value, ascending
    mids = (points[1:] + points[:-1]) / 2
    top = FP8_FORMATS[fmt].max_finite
    candidates = np.concatenate(
        [
            mids,
            np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
            np.nextafter(mids.astype(np.float32), np.float32(0)),
            points,
            [top * 1.0625, top * 4, 1e30],
        ]
    ).astype(np.float32)
    pick = torch.randint(0, len(candidates), (rows, 2, 16), generator=gen)
    sign = torch.where(torch.rand(rows, 2, 16, generator=gen) < 0.5, -1.0, 1.0)
    return torch.from_numpy(candidates)[pick] * sign


def _kv_writes(device: torch.device, out: dict[str, torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, rows = 6, 4, 20
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    slots[::7] = -1
    shape = (num_blocks, block_size, 2, 16)
    key = torch.randn(rows + 2, 2, 16, generator=gen).half()
    k, v = (torch.full(shape, float("nan"), dtype=torch.float16).to(device) for _ in "kv")
    reshape_and_cache(key.to(device), (-key).to(device), k, v, slots.to(device))
    out["kv_write float16 K"], out["kv_write float16 V"] = k.cpu(), v.cpu()
    for fmt, (k_scale, v_scale) in FP8_SCALES.items():
        x = _near_ties(fmt, rows + 2, gen)
        k = torch.full(shape, float("nan")).to(FP8_TORCH[fmt]).to(device)
        v = k.clone()
        key, value = (x * k_scale).to(device), (x.flip(0) * v_scale).to(device)
        reshape_and_cache(key, value, k, v, slots.to(device), k_scale=k_scale, v_scale=v_scale)
        out[f"kv_write {fmt} K"] = k.view(torch.uint8).cpu()
        out[f"kv_write {fmt} V"] = v.view(torch.uint8).cpu()


def _block_copy(device: torch.device, out: dict[str, torch.Tensor]) -> None:
    gen = torch.Generator().manual_seed(6)
    caches = [torch.randn(8, 4, 2, 16, generator=gen).bfloat16().to(device) for _ in range(4)]
    copy_blocks(caches[:2], caches[2:], [(0, 5), (3, 1), (3, 7)])
    for i, cache in enumerate(caches):
        out[f"block_copy layer {i % 2} {'KV'[i // 2]}"] = cache.cpu()


def _attention(device: torch.device, out: dict[str, torch.Tensor]) -> None:
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device)
    for dtype in ("float16", "bfloat16", "float32"):
        for kv_dtype in (None, "fp8_e4m3"):
            scales = [FP8_SCALES[kv_dtype]] if kv_dtype else []
            s = make_scenario(
                7, WORK, block_size=16, num_kv_heads=2, group=2, head_dim=32, dtype=dtype,
                kv_dtype=kv_dtype, kv_scales=scales,
            )  # fmt: skip
            cache_dtype = FP8_TORCH[kv_dtype] if kv_dtype else TORCH_DTYPES[dtype]
            k, v = (
                torch.from_numpy(x[0]).to(cache_dtype).to(device).contiguous()
                for x in (s.memory.k, s.memory.v)
            )
            a = s.batch.arrays()
            qsl, lens, tables = (
                torch.from_numpy(x).to(device)
                for x in (a.query_start_loc, a.seq_lens, a.block_tables)
            )
            q = torch.from_numpy(s.queries[0]).to(TORCH_DTYPES[dtype]).to(device)
            k_scale, v_scale = scales[0] if scales else (1.0, 1.0)
            kv = kv_dtype or "unquantized"
            for splits in (1, 3):
                for every in (False, True):  # plain, or a window, a softcap and sinks at once
                    got = paged_attention(
                        q, k, v, qsl, lens, tables, 0.3, num_splits=splits, block_n=16,
                        k_scale=k_scale, v_scale=v_scale, window=19 if every else None,
                        softcap=5.0 if every else None, sinks=sinks if every else None,
                    )  # fmt: skip
                    name = "every variant" if every else "plain"
                    out[f"attention {dtype} {kv} {splits} splits {name}"] = got.cpu()


def outputs(device: torch.device) -> dict[str, torch.Tensor]:
    """Every result of the workload on ``device``, as CPU tensors, by name."""
    out: dict[str, torch.Tensor] = {}
    _kv_writes(device, out)
    _block_copy(device, out)
    _attention(device, out)
    return out


if __name__ == "__main__":
    torch.save(outputs(torch.device("cpu")), sys.argv[1])
