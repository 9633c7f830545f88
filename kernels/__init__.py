"""Triton and CUDA kernels for the Llama of 01_single_gpu (playbook chapter 4). See kernels/README.md.

This file only repairs Triton's CPU interpreter (TRITON_INTERPRET=1), which the tests run on. It acts
at import, the one moment every kernel module of this package passes through first; without the
environment variable (every GPU run) it does nothing. Three gaps in Triton 3.6's interpreter are
closed, and the fixes only change how the interpreter emulates the GPU, never what a kernel computes:

1. A runtime loop bound (`for start_n in range(0, hi, BLOCK_N)`) becomes a Python int through
   `int(array_of_one_element)`. NumPy 2.4 made that a TypeError. This is the upstream fix of
   triton-lang/triton#9171 (PR #9172, `.item()`), not yet in a release.
2. The interpreter stores bfloat16 as raw uint16 bits, and its `tl.dot` multiplies those bits
   (triton-lang/triton#11584; the docs say bf16 is unsupported in the interpreter). We widen bf16
   dot operands to float32 first. That is exact: a bf16 value is a float32 with the low 16 mantissa
   bits zero. It is also what the tensor cores compute: exact bf16 products, float32 accumulation.
3. Its float32 -> bfloat16 cast (`x.to(tl.bfloat16)`) truncates the mantissa. The GPU rounds to
   nearest even, so every bf16 store came out up to one extra ulp off. We round to nearest even.
"""
import os

if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"):
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as _interpreter

    _original_patch_lang_tensor = _interpreter._patch_lang_tensor
    _original_create_dot = _interpreter.InterpreterBuilder.create_dot
    _original_cast_impl = _interpreter.InterpreterBuilder.cast_impl

    def _patch_lang_tensor(tensor, scope):
        _original_patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    def _bf16_as_fp32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16          # bf16 bits are the top half of a float32
        return _interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return _original_create_dot(self, _bf16_as_fp32(a), _bf16_as_fp32(b), d, input_precision,
                                    max_num_imprecise_acc)

    def _cast_impl(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return _original_cast_impl(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        # Round to nearest even on the 16 dropped bits: add 0x7FFF plus the lowest kept bit, then drop them.
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)   # keep NaN a NaN
        return _interpreter.TensorHandle(rounded, tl.bfloat16)

    _interpreter._patch_lang_tensor = _patch_lang_tensor
    _interpreter.InterpreterBuilder.cast_impl = _cast_impl
    _interpreter.InterpreterBuilder.create_dot = _create_dot
