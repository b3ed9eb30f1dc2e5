"""The corrections, patched into Triton's interpreter (``TRITON_INTERPRET=1``; 3.9, and 3.6).

What the interpreter gets wrong, and what each patch does instead:

- float arithmetic a GPU computes approximately, and numpy exactly: a plain
  division (``div.full.f32``), ``tl.exp2``, ``tl.exp``, ``tl.sqrt``, and a
  float32 ``tl.dot`` at its default precision (TF32 operands). Patched: the
  emulations of :mod:`conformance.interpreter.arithmetic`, each checked
  against the PTX of both Triton releases (``tests/test_interpreter_ptx.py``).
- launch options (``num_warps=``, ...): the interpreter drops any keyword
  that is not a parameter, typos included, and the shim's own 64-bit
  binding choked on them. Patched: :mod:`conformance.interpreter.launch`
  takes them as compiled Triton does, and names one it cannot honour.
- what a launch would compile: nothing, here. Recorded: the specialisation
  compiled Triton's JIT would key it by
  (:mod:`conformance.interpreter.specialisations`), so a run can say how
  many kernels a GPU run of it compiles.

- float to fp8 (``fp8e4nv``, ``fp8e5``) and back: it truncates or rounds
  half up, flushes subnormals, wraps overflow to NaN or junk, and reads the
  e4m3fn NaN as 480. Patched: :mod:`conformance.interpreter.floats`, the
  ``cvt.rn.satfinite`` conversions compiled Triton emits for sm_90.
- float to bfloat16: it truncates; patched to round to nearest even
  (``cvt.rn.bf16.f32``; ``rtz`` when the kernel asks for it).
- bfloat16 arithmetic: it keeps bfloat16 as raw ``uint16`` bits and runs
  numpy on them (integer addition, unsigned comparisons). Patched: each
  operation, math function, ``tl.dot``, sum, min and max runs on the
  float32 values and rounds the result back to nearest even (exact for
  +, -, *, /, sqrt: float32 holds more than twice bfloat16's precision).
- ``tl.int64`` (and ``tl.uint64``) parameter annotations: ``_implicit_cvt``
  turns every Python int that fits into int32, so ``pid * stride`` wraps
  where compiled Triton computes in 64 bits. Patched: an int passed to a
  parameter annotated 64-bit becomes a 64-bit scalar.
- integer overflow checks: compiled Triton emits them only in debug mode,
  and so does the interpreter's ``device_assert``; but the interpreter
  computes every check (each integer ``+``, ``-`` and ``*`` redone in 64
  bits and compared) before discarding it, a quarter of its time on this
  project's kernels. Patched: not computed unless ``debug`` is on.
- speed, not values: every call of a ``@triton.jit`` helper inside a kernel
  patches the language module again (a walk over all its members), though
  the launch (or an earlier helper) already did, and nothing restores it
  before the launch ends. Patched: a helper that sees no language module
  not yet patched in this launch is called directly. And the interpreter
  rebuilds a table of twenty numpy dtypes to look up one (for every
  operation), and a block type for every operation's result: both are
  looked up once per type and shape, then remembered.

Not corrected, and raised as :class:`~conformance.interpreter.limits.InterpreterLimit`
instead: conversions to or from the other fp8 formats (``fp8e4b15``,
``fp8e4b8``, ``fp8e5b16``: not sm_90 formats) and fp8 with ``rtz``. Not
bit-exact either: a bfloat16 ``tl.sum`` accumulates in float32 here, in
bfloat16 in a hardware-chosen tree order when compiled.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import numpy as np

from conformance.interpreter.arithmetic import (
    div_approx,
    div_full,
    ex2_approx_ftz,
    exp_via_ex2,
    in_float32,
    sqrt_approx_ftz,
    tf32,
)
from conformance.interpreter.floats import (
    FP8_FORMATS,
    bf16_decode,
    bf16_encode,
    fp8_decode,
    fp8_encode,
)
from conformance.interpreter.launch import split_options
from conformance.interpreter.limits import InterpreterLimit
from conformance.interpreter.specialisations import key, record

_OTHER_FP8 = ("fp8e4b15", "fp8e4b8", "fp8e5b16")


def _name(dtype: Any) -> str:
    return str(getattr(dtype, "name", dtype))


def _special(dtype: Any) -> bool:
    """bfloat16 or an fp8 format: stored as raw bits by the interpreter."""
    name = _name(dtype)
    return name == "bf16" or name.startswith("fp8")


def _to_f32(data: Any, dtype: Any) -> Any:
    """The float values of interpreter data of ``dtype`` (bits decoded where raw)."""
    name = _name(dtype)
    if name == "bf16":
        return bf16_decode(data)
    if name in FP8_FORMATS:
        return fp8_decode(data, name)
    if name in _OTHER_FP8:
        raise InterpreterLimit(f"a conversion from {name}")
    return data


def _from_values(values: Any, dtype: Any, np_dtype: Any, toward_zero: bool) -> Any:
    """Interpreter data of ``dtype`` for ``values``, rounded as compiled Triton rounds."""
    name = _name(dtype)
    if name == "bf16":
        return bf16_encode(np.asarray(values).astype(np.float32), toward_zero=toward_zero)
    if name in FP8_FORMATS:
        if toward_zero:
            raise InterpreterLimit(f"a conversion to {name} rounding toward zero")
        return fp8_encode(np.asarray(values).astype(np.float32), name)
    if name in _OTHER_FP8:
        raise InterpreterLimit(f"a conversion to {name}")
    return np.asarray(values).astype(np_dtype)


def _emulated(fn: Any, fallback: Any) -> Any:
    """An interpreter op computing ``fn`` (:mod:`.arithmetic`) on float16 and float32 data (and
    on bfloat16, which :func:`_patches`'s ``binary_op``/``unary_op`` hand over decoded), and
    ``fallback`` (numpy's own) on anything else."""
    wrapped = in_float32(fn)

    def op(*args: Any) -> Any:
        out = wrapped(*args)
        return fallback(*args) if out is None else out

    return op


def _patches(interp: Any) -> dict[tuple[Any, str], Any]:
    """Every replacement, keyed by (owner, attribute); each falls back to the original."""
    builder = interp.InterpreterBuilder
    reduce_ops = interp.ReduceOps
    handle_cls, tl = interp.TensorHandle, interp.tl
    rtz = interp._ir.ROUNDING_MODE.RTZ
    orig = {
        name: getattr(builder, name)
        for name in (
            "cast_impl",
            "create_fp_to_fp",
            "binary_op",
            "unary_op",
            "ternary_op",
            "create_fma",
            "create_rsqrt",
            "create_dot",
        )
    }
    orig_sum, orig_min_max = reduce_ops.sum, reduce_ops.min_max
    orig_cvt, orig_call = interp._implicit_cvt, interp.GridExecutor.__call__

    def convert(src: Any, dst_type: Any, toward_zero: bool) -> Any:
        src_t, dst_t = src.dtype.scalar, dst_type.scalar
        values = _to_f32(src.data, src_t)
        data = _from_values(values, dst_t, interp._get_np_dtype(dst_type), toward_zero)
        return handle_cls(data, dst_t)

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if not (_special(src.dtype.scalar) or _special(dst_type.scalar)):
            return orig["cast_impl"](self, src, dst_type)
        return convert(src, dst_type, toward_zero=False)

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        if not (_special(src.dtype.scalar) or _special(dst_type.scalar)):
            return orig["create_fp_to_fp"](self, src, dst_type, rounding_mode)
        return convert(src, dst_type, toward_zero=rounding_mode == rtz)

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        if _name(lhs.dtype.scalar) != "bf16" or _name(rhs.dtype.scalar) != "bf16":
            return orig["binary_op"](self, lhs, rhs, op)
        out = op(bf16_decode(lhs.data), bf16_decode(rhs.data))
        if out.dtype == np.bool_:  # a comparison: the interpreter's own form for bf16
            return handle_cls(out.astype(np.uint16), lhs.dtype.scalar)
        return handle_cls(bf16_encode(out.astype(np.float32)), lhs.dtype.scalar)

    def unary_op(self: Any, arg: Any, op: Any) -> Any:
        if _name(arg.dtype.scalar) != "bf16":
            return orig["unary_op"](self, arg, op)
        out = np.asarray(op(bf16_decode(arg.data)))
        if out.dtype.kind != "f":
            return handle_cls(out, arg.dtype.scalar)
        return handle_cls(bf16_encode(out.astype(np.float32)), arg.dtype.scalar)

    def create_rsqrt(self: Any, arg: Any) -> Any:
        if _name(arg.dtype.scalar) != "bf16":
            return orig["create_rsqrt"](self, arg)
        return handle_cls(bf16_encode(1 / np.sqrt(bf16_decode(arg.data))), arg.dtype.scalar)

    def ternary_op(self: Any, lhs: Any, rhs: Any, other: Any, op: Any) -> Any:
        if op is not np.clip or _name(other.dtype.scalar) != "bf16":
            return orig["ternary_op"](self, lhs, rhs, other, op)
        out = np.clip(bf16_decode(lhs.data), bf16_decode(rhs.data), bf16_decode(other.data))
        return handle_cls(bf16_encode(out), other.dtype.scalar)

    def create_fma(self: Any, x: Any, y: Any, z: Any) -> Any:
        if _name(z.dtype.scalar) != "bf16":
            return orig["create_fma"](self, x, y, z)
        a, b, c = (bf16_decode(h.data).astype(np.float64) for h in (x, y, z))
        return handle_cls(bf16_encode((a * b + c).astype(np.float32)), z.dtype.scalar)

    tf32_precision = getattr(interp._ir.INPUT_PRECISION, "TF32", None)

    def create_dot(self: Any, a: Any, b: Any, d: Any, precision: Any, imprecise: Any) -> Any:
        if precision == tf32_precision and _name(a.dtype.scalar) == _name(b.dtype.scalar) == "fp32":
            a = handle_cls(tf32(a.data), a.dtype.scalar)  # mma.sync ... .tf32: operands truncated
            b = handle_cls(tf32(b.data), b.dtype.scalar)
        if not (_special(a.dtype.scalar) or _special(b.dtype.scalar)):
            return orig["create_dot"](self, a, b, d, precision, imprecise)
        lhs = np.asarray(_to_f32(a.data, a.dtype.scalar), dtype=np.float32)
        rhs = np.asarray(_to_f32(b.data, b.dtype.scalar), dtype=np.float32)
        if _special(d.dtype.scalar):
            acc = _to_f32(d.data, d.dtype.scalar)
            out = np.matmul(lhs, rhs, dtype=np.float32) + acc
            return handle_cls(_from_values(out, d.dtype.scalar, None, False), d.dtype.scalar)
        out = np.matmul(lhs, rhs, dtype=d.data.dtype) + d.data
        return handle_cls(out, d.dtype.scalar)

    def reduce_sum(self: Any, input: Any) -> Any:
        if _name(input.dtype) != "bf16":
            return orig_sum(self, input)
        total = np.sum(
            bf16_decode(input.handle.data),
            axis=self.axis,
            keepdims=self.keep_dims,
            dtype=np.float32,
        )
        return self.to_tensor(bf16_encode(np.asarray(total)), input.dtype)

    def min_max(self: Any, input: Any, val_reduce_op: Any, idx_reduce_op: Any = None) -> Any:
        x = input[0] if isinstance(input, tuple) else input
        if _name(x.dtype) != "bf16":
            return orig_min_max(self, input, val_reduce_op, idx_reduce_op)
        data = bf16_decode(x.handle.data)
        keep = {"axis": self.axis, "keepdims": self.keep_dims}
        val = idx = None
        if val_reduce_op:
            val = self.to_tensor(bf16_encode(np.asarray(val_reduce_op(data, **keep))), x.dtype)
        if idx_reduce_op:
            idx = self.to_tensor(idx_reduce_op(data, **keep), tl.int32)
        if val is not None and idx is not None:
            return val, idx
        return val if val is not None else idx

    def implicit_cvt(arg: Any) -> Any:
        if isinstance(arg, _Wide):
            ty = tl.uint64 if arg.unsigned else tl.int64
            data = np.array([int(arg)], dtype=np.uint64 if arg.unsigned else np.int64)
            return tl.tensor(handle_cls(data, ty), ty)
        return orig_cvt(arg)

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs, _ = split_options(self.fn, kwargs)  # launch options: checked, as compiled
        wide = _wide_parameters(self.fn)
        if wide:
            bound = inspect.signature(self.fn).bind_partial(*args, **kwargs)
            for name, unsigned in wide.items():
                value = bound.arguments.get(name)
                if isinstance(value, int) and not isinstance(value, bool):
                    bound.arguments[name] = _Wide(value, unsigned)
            args, kwargs = bound.args, dict(bound.kwargs)
        _LAUNCHES.append(_langs(interp, self.fn))
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            _LAUNCHES.pop()

    orig_run = interp.InterpretedFunction.__dict__["run"]

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if not warmup:  # the specialisation a compiled launch would look up (and compile once)
            params, options = split_options(self.fn, kwargs)
            try:
                found = key(self.fn, self.kwargs.get("do_not_specialize"), args, params)
            except Exception as err:  # an argument Triton's JIT would refuse: counted, unread
                found = (f"unreadable: {type(err).__name__}",)
            record(self.fn.__qualname__, found, options)
        return orig_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    orig_device_call = interp.InterpretedFunction.__dict__["__call__"]

    def device_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        langs = _langs(interp, self.fn)
        if not _LAUNCHES or not langs <= _LAUNCHES[-1]:
            if _LAUNCHES:  # patched now, and left patched until the launch ends
                _LAUNCHES[-1] = _LAUNCHES[-1] | langs
            return orig_device_call(self, *args, **kwargs)
        fn = self.rewrite()  # the language this function sees is patched: not again
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    orig_np_dtype, orig_block_ty = interp._get_np_dtype, builder.get_block_ty
    np_dtypes: dict[Any, Any] = {}
    block_types: dict[tuple[Any, tuple[int, ...]], Any] = {}

    def np_dtype(tt_dtype: Any) -> Any:
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):
            return orig_np_dtype(tt_dtype)
        try:
            found = np_dtypes.get(element)
        except TypeError:
            return orig_np_dtype(tt_dtype)
        if found is None:
            found = np_dtypes[element] = orig_np_dtype(element)
        return found

    def get_block_ty(self: Any, dtype: Any, shape: Any) -> Any:
        if isinstance(dtype, tl.pointer_type):
            return orig_block_ty(self, dtype, shape)
        key = (dtype, tuple(shape))
        try:
            found = block_types.get(key)
        except TypeError:  # a shape of constexprs or a type that does not hash: build it
            return orig_block_ty(self, dtype, shape)
        if found is None:
            found = block_types[key] = orig_block_ty(self, dtype, shape)
        return found

    div, approx = _emulated(div_full, np.divide), _emulated(div_approx, np.divide)
    ex2, exp = _emulated(ex2_approx_ftz, np.exp2), _emulated(exp_via_ex2, np.exp)
    sqrt = _emulated(sqrt_approx_ftz, np.sqrt)
    options = interp.interpreter_builder.options
    out: dict[tuple[Any, str], Any] = {
        (builder, "create_fdiv"): lambda self, lhs, rhs: self.binary_op(lhs, rhs, div),
        (builder, "create_exp2"): lambda self, arg: self.unary_op(arg, ex2),
        (builder, "create_exp"): lambda self, arg: self.unary_op(arg, exp),
        (builder, "create_sqrt"): lambda self, arg: self.unary_op(arg, sqrt),
        (interp.interpreter_builder, "options"): replace(
            options, sanitize_overflow=options.sanitize_overflow and options.debug
        ),
        (builder, "cast_impl"): cast_impl,
        (builder, "create_fp_to_fp"): create_fp_to_fp,
        (builder, "binary_op"): binary_op,
        (builder, "unary_op"): unary_op,
        (builder, "ternary_op"): ternary_op,
        (builder, "create_fma"): create_fma,
        (builder, "create_rsqrt"): create_rsqrt,
        (builder, "create_dot"): create_dot,
        (reduce_ops, "sum"): reduce_sum,
        (reduce_ops, "min_max"): min_max,
        (interp, "_implicit_cvt"): implicit_cvt,
        (interp.GridExecutor, "__call__"): call,
        (interp.InterpretedFunction, "run"): run,
        (interp.InterpretedFunction, "__call__"): device_call,
        (interp, "_get_np_dtype"): np_dtype,
        (builder, "get_block_ty"): get_block_ty,
    }
    if "create_approx_divf" in builder.__dict__:  # tl.fdiv(approx=True): Triton 3.9 on
        out[(builder, "create_approx_divf")] = lambda self, l, r: self.binary_op(l, r, approx)
    return out


_LAUNCHES: list[frozenset[int]] = []
"""Per kernel launch in progress, the language modules patched so far (by id): by the launch,
or by a helper's call (Triton does not restore those before the launch ends)."""


def _langs(interp: Any, fn: Any) -> frozenset[int]:
    """The language modules (``triton.language``, its ``core``) that ``fn``'s globals name."""
    tl = interp.tl
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


class _Wide(int):
    """An int passed to a parameter annotated ``tl.int64`` or ``tl.uint64``."""

    unsigned: bool

    def __new__(cls, value: int, unsigned: bool) -> _Wide:
        self = super().__new__(cls, value)
        self.unsigned = unsigned
        return self


def _wide_parameters(fn: Any) -> dict[str, bool]:
    """Parameters annotated 64-bit integer: name -> unsigned."""
    from triton.runtime.jit import _normalize_ty

    out: dict[str, bool] = {}
    for name, ty in inspect.get_annotations(fn).items():
        try:
            norm = _normalize_ty(ty)
        except Exception:  # an annotation Triton does not read as a type is not ours to judge
            continue
        if norm in ("i64", "u64"):
            out[name] = norm == "u64"
    return out


class Shim:
    """The installed patches and the originals they replace; installs nest."""

    def __init__(self) -> None:
        self.saved: dict[tuple[Any, str], Any] = {}
        self.depth = 0

    def install(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        from triton.runtime import interpreter

        patches = _patches(interpreter)
        for (owner, name), fn in patches.items():
            self.saved[(owner, name)] = owner.__dict__[name]
            setattr(owner, name, fn)

    def uninstall(self) -> None:
        if self.depth == 0:
            return
        self.depth -= 1
        if self.depth > 0:
            return
        for (owner, name), original in self.saved.items():
            setattr(owner, name, original)
        self.saved.clear()

    @property
    def installed(self) -> bool:
        return self.depth > 0


SHIM = Shim()
