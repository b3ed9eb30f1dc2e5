"""The kernels compile for a real GPU (sm_90, Hopper), even on a machine without one.

The interpreter runs kernel bodies as Python, so it accepts code the compiler
rejects (a non-constexpr global, a type that changes across loop iterations, a
shared-memory budget overrun). This compiles each kernel through Triton's whole
NVIDIA pipeline (frontend, LLVM, the bundled ptxas) in a subprocess with the
interpreter off, for the configurations the GPU plan picks: every dtype, the
split-KV path, every attention variant and both fp8 KV formats.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import backend_gpu
    from backend_gpu.kernels import attention, block_copy, kv_write, slot_mapping

    INT_PTRS = {"query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"}
    F32_PTRS = {"lse_ptr", "part_ptr", "sinks_ptr", "alibi_ptr"}
    CACHE_PTRS = {"k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"}
    F32_ARGS = {"score_mul", "cap_log2", "v_scale", "k_scale"}
    FP8 = {"e4m3": dict(FP8_MANT=3, FP8_MIN_EXP=-6), "e5m2": dict(FP8_MANT=2, FP8_MIN_EXP=-14)}
    PLAIN = dict(FP8_MANT=0, FP8_MIN_EXP=0)
    NO_VARIANT = dict(USE_SOFTCAP=False, USE_ALIBI=False, USE_WINDOW=False, USE_SINKS=False)

    def compile_one(fn, dtype, consts, **options):
        sig = {}
        for param in fn.params:
            name = param.name
            if param.is_constexpr:
                sig[name] = "constexpr"
            elif name == "slot_ptr" or name == "pairs_ptr":
                sig[name] = "*i64"
            elif name in INT_PTRS:
                sig[name] = "*i32"
            elif name in F32_PTRS or (name == "out_ptr" and consts.get("SPLIT")):
                sig[name] = "*fp32"
            elif name in CACHE_PTRS and consts.get("FP8_MANT"):
                sig[name] = "*u8"
            elif name.endswith("_ptr"):
                sig[name] = "*" + dtype
            else:
                sig[name] = "fp32" if name in F32_ARGS else "i32"
        kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                options=options)
        return kernel.metadata.shared

    def attention_consts(g, hd, hp, bq, bn, split, up, **extra):
        return dict(GROUP=g, GROUP_PAD=g, HEAD_DIM=hd, HEAD_PAD=hp, BLOCK_SIZE=16, BLOCK_Q=bq,
                    BLOCK_M=bq * g, BLOCK_N=bn, SPLIT=split, UPCAST=up, IEEE=up,
                    **{**NO_VARIANT, **PLAIN, **extra})

    shared = []
    for dtype, up in (("fp16", False), ("bf16", False), ("fp32", True)):
        for split in (False, True):
            for g, hd, hp, bq, bn, stages in ((4, 128, 128, 4, 64, 2), (8, 256, 256, 8, 32, 1)):
                if dtype != "fp16" and (split or g == 8):
                    continue  # one dtype covers the variants; the others cover the casts
                consts = attention_consts(g, hd, hp, bq, bn, split, up)
                shared.append(compile_one(attention._attention_kernel, dtype, consts,
                                          num_warps=4, num_stages=stages))
    # every attention variant at once, and each fp8 format, in the decode and prefill tiles,
    # single pass and split (the sink then moves to the merge)
    every = dict(USE_SOFTCAP=True, USE_ALIBI=True, USE_WINDOW=True, USE_SINKS=True)
    for dtype, split, fp8, (g, bq) in (("bf16", False, "e4m3", (4, 4)),
                                       ("fp16", True, "e5m2", (4, 4)),
                                       ("fp16", False, "e4m3", (4, 16)),
                                       ("bf16", True, None, (8, 8))):
        consts = attention_consts(g, 128, 128, bq, 64, split, False,
                                  **every, **(FP8[fp8] if fp8 else {}))
        shared.append(compile_one(attention._attention_kernel, dtype, consts,
                                  num_warps=4, num_stages=2))
    for sinks in (False, True):
        shared.append(compile_one(attention._merge_kernel, "bf16",
                                  dict(HEAD_DIM=96, HEAD_PAD=128, SPLIT_PAD=8, USE_SINKS=sinks)))
    for fp8 in (None, "e4m3", "e5m2"):
        quant = dict(FP8[fp8], FP8_MAX=448.0 if fp8 == "e4m3" else 57344.0) if fp8 else dict(
            PLAIN, FP8_MAX=0.0)
        shared.append(compile_one(kv_write._kv_write_kernel, "bf16",
                                  dict(NUM_KV_HEADS=8, HEAD_DIM=128, ROW_PAD=1024, BLOCK_T=4,
                                       **quant)))
    for dtype in ("fp16", "u8"):  # an fp8 cache is copied as bytes
        shared.append(compile_one(block_copy._block_copy_kernel, dtype, dict(CHUNK=2048)))
    shared.append(compile_one(slot_mapping._slot_mapping_kernel, "fp16",
                              dict(BLOCK_SIZE=3, BLOCK_Q=256)))
    print(json.dumps(shared))
    """
)


def test_every_kernel_compiles_for_hopper() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        pytest.fail(f"compilation failed:\n{result.stderr[-4000:]}")
    shared = [int(x) for x in result.stdout.strip().splitlines()[-1].strip("[]").split(",")]
    assert len(shared) == 18
    assert max(shared) <= 227 * 1024, f"shared memory {max(shared)} B exceeds Hopper's 227 KiB"


_LATENT_PROBE = textwrap.dedent(
    """
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import backend_gpu
    from backend_gpu.kernels import latent_attention, latent_write

    F32_PTRS = {"lse_ptr", "part_ptr", "sinks_ptr", "alibi_ptr"}
    INT_PTRS = {"query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"}
    FP8 = {"e4m3": dict(FP8_MANT=3, FP8_MIN_EXP=-6), "e5m2": dict(FP8_MANT=2, FP8_MIN_EXP=-14)}
    PLAIN = dict(FP8_MANT=0, FP8_MIN_EXP=0)
    NO_VARIANT = dict(USE_SOFTCAP=False, USE_ALIBI=False, USE_WINDOW=False, USE_SINKS=False)
    EVERY = dict(USE_SOFTCAP=True, USE_ALIBI=True, USE_WINDOW=True, USE_SINKS=True)

    def compile_one(fn, dtype, consts, **options):
        sig = {}
        for p in fn.params:
            name = p.name
            if p.is_constexpr:
                sig[name] = "constexpr"
            elif name == "slot_ptr":
                sig[name] = "*i64"
            elif name in INT_PTRS:
                sig[name] = "*i32"
            elif name in F32_PTRS or (name == "out_ptr" and consts.get("SPLIT")):
                sig[name] = "*fp32"
            elif name == "cache_ptr" and consts.get("FP8_MANT"):
                sig[name] = "*u8"
            elif name.endswith("_ptr"):
                sig[name] = "*" + dtype
            else:
                real = "scale" in name or name in ("score_mul", "cap_log2")
                sig[name] = "fp32" if real else "i32"
        kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                options=options)
        return kernel.metadata.shared

    def consts(heads, latent, rope, bq, bn, split, up, **extra):
        pad = lambda n: max(16, triton.next_power_of_2(n))
        return dict(NUM_HEADS=128, HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads),
                    LATENT=latent, LATENT_PAD=pad(latent), ROPE=rope, ROPE_PAD=pad(rope),
                    BLOCK_SIZE=64, BLOCK_Q=bq, BLOCK_M=bq * triton.next_power_of_2(heads),
                    BLOCK_N=bn, SPLIT=split, UPCAST=up, IEEE=up,
                    **{**NO_VARIANT, **PLAIN, **extra})

    shared = []
    # DeepSeek-V3's 512 + 64 rows in the GPU plan's decode tile (16 heads, 32 keys, 8 warps):
    # bfloat16 plain, float16 split with every variant and fp8 rows, float32 (IEEE products)
    for dtype, up, split, extra in (("bf16", False, False, {}),
                                    ("fp16", False, True, {**EVERY, **FP8["e4m3"]}),
                                    ("fp32", True, False, {})):
        shared.append(compile_one(latent_attention._latent_kernel, dtype,
                                  consts(16, 512, 64, 1, 32, split, up, **extra),
                                  num_warps=8, num_stages=1))
    # a small layout (32 + 16) in the prefill tile: 4 heads x 16 tokens, 64 keys, fp8 e5m2
    shared.append(compile_one(latent_attention._latent_kernel, "fp16",
                              consts(4, 32, 16, 16, 64, False, False, **EVERY, **FP8["e5m2"]),
                              num_warps=4, num_stages=2))
    shared.append(compile_one(latent_attention._merge_kernel, "bf16",
                              dict(NUM_HEADS=128, HEADS=16, LATENT=512, LATENT_PAD=512,
                                   SPLIT_PAD=16, USE_SINKS=True)))
    shared.append(compile_one(latent_write._latent_write_kernel, "bf16",
                              dict(LATENT=512, ROPE=64, ROW_PAD=1024, BLOCK_T=4,
                                   **FP8["e4m3"], FP8_MAX=448.0)))
    print(json.dumps(shared))
    """
)


def test_latent_kernels_compile_for_hopper() -> None:
    """The latent attention, its merge and the row write, at DeepSeek-V3's 512 + 64 (the row
    split into a 512 and a 64 tile, powers of two as ``tl.dot`` needs) and at 32 + 16."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-c", _LATENT_PROBE], env=env, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        pytest.fail(f"compilation failed:\n{result.stderr[-4000:]}")
    shared = [int(x) for x in result.stdout.strip().splitlines()[-1].strip("[]").split(",")]
    assert len(shared) == 6
    assert max(shared) <= 227 * 1024, f"shared memory {max(shared)} B exceeds Hopper's 227 KiB"


def test_triton_imported_first_without_cuda_is_a_clear_error() -> None:
    """Triton's language is built interpreted or compiled when first imported: imported
    before ``backend_gpu`` turns the interpreter on, its kernels could not run on CPU
    tensors, and the import says so instead of failing later inside a kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no CUDA, on a GPU machine too
    late = subprocess.run(
        [sys.executable, "-c", "import triton, backend_gpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert late.returncode != 0
    assert "set TRITON_INTERPRET=1 before importing triton" in late.stderr
    first = subprocess.run(
        [sys.executable, "-c", "import backend_gpu, triton.language as tl; print(type(tl.zeros))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0 and "InterpretedFunction" in first.stdout, first.stderr
