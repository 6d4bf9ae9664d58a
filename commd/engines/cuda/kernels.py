"""The node-local arithmetic on a device, as cupy elementwise kernels.

Bit-for-bit the same results as ``host_ops``: each operation on float16 and float32 is
computed in float32 and rounded once, float64 in float64; bfloat16 (raw uint16 words) is
widened to float32 and rounded back to nearest-even. A sum of several local ranks is one
``add`` per rank, each rounded to the dtype, as NCCL's and Gloo's own additions are. The
kernels are built lazily and cached per process;
``compile_all`` runs each once so that NVRTC never runs on the event loop.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

# C type of each dtype's elements, and the type the arithmetic runs in.
_C_TYPE = {"float16": "float16", "float32": "float", "float64": "double",
           "bfloat16": "unsigned short"}
_WIDE = {"float16": "float", "float32": "float", "float64": "double", "bfloat16": "float"}
_PARAM = {"float16": "float16", "float32": "float32", "float64": "float64", "bfloat16": "uint16"}

_BF16 = r"""
__device__ __forceinline__ float commd_widen(unsigned short w) {
    return __uint_as_float(((unsigned int)w) << 16);
}
__device__ __forceinline__ unsigned short commd_narrow(float v) {
    unsigned int b = __float_as_uint(v);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (unsigned short)(b >> 16);
}
"""


def _load(dtype: str) -> str:
    return "commd_widen({0})" if dtype == "bfloat16" else f"({_WIDE[dtype]})({{0}})"


def _store(dtype: str, expression: str) -> str:
    if dtype == "bfloat16":
        return f"commd_narrow({expression})"
    return f"({_C_TYPE[dtype]})({expression})"


KERNELS = ("add", "scale", "scale_copy")


def spec(name: str, dtype: str) -> tuple[str, str, str, str, str]:
    """(in_params, out_params, operation, kernel name, preamble) of one kernel: add (t += s),
    scale (x *= f), scale_copy (x *= f; y = x)."""
    p, wide = _PARAM[dtype], _WIDE[dtype]
    load = _load(dtype).format
    factor = f"{_param_of(wide)} f"
    if name == "add":
        args = (f"{p} s", f"{p} t", f"t = {_store(dtype, load('t') + ' + ' + load('s'))};")
    elif name == "scale":
        args = (factor, f"{p} x", f"x = {_store(dtype, load('x') + ' * f')};")
    elif name == "scale_copy":
        body = f"{_C_TYPE[dtype]} v = {_store(dtype, load('x') + ' * f')}; x = v; y = v;"
        args = (factor, f"{p} x, {p} y", body)
    else:
        raise ValueError(f"no kernel {name!r}; kernels: {', '.join(KERNELS)}")
    return (*args, f"commd_{name}_{dtype}", _BF16 if dtype == "bfloat16" else "")


@functools.cache
def _kernel(cupy: Any, name: str, dtype: str) -> Any:
    in_params, out_params, operation, kernel_name, preamble = spec(name, dtype)
    return cupy.ElementwiseKernel(in_params, out_params, operation, name=kernel_name,
                                  preamble=preamble)


def _param_of(wide: str) -> str:
    return "float64" if wide == "double" else "float32"


def _factor(cupy: Any, dtype: str, factor: float) -> Any:
    return cupy.float64(factor) if _WIDE[dtype] == "double" else cupy.float32(factor)


def sum_into(cupy: Any, target: Any, sources: Sequence[Any], dtype: str) -> None:
    """target += every source, in order, each addition rounded to ``dtype`` (as
    ``host_ops.sum_into``); on the current device and stream."""
    for source in sources:
        _kernel(cupy, "add", dtype)(source, target)


def finish(cupy: Any, source: Any, targets: Sequence[Any], factor: float, dtype: str) -> None:
    """source *= factor (unless 1), copied into every target; the scaling is fused with the
    first copy, so avg costs no extra pass over memory."""
    rest = list(targets)
    if factor != 1.0:
        f = _factor(cupy, dtype, factor)
        if rest:
            _kernel(cupy, "scale_copy", dtype)(f, source, rest.pop(0))
        else:
            _kernel(cupy, "scale", dtype)(f, source)
    for target in rest:
        cupy.copyto(target, source)


def compile_all(cupy: Any, dtype: str) -> None:
    """Run every kernel ``dtype`` needs once on tiny buffers (compiles them)."""
    element = cupy.uint16 if dtype == "bfloat16" else getattr(cupy, dtype)
    a, b, c = (cupy.zeros(4, dtype=element) for _ in range(3))
    sum_into(cupy, a, [b], dtype)
    sum_into(cupy, a, [b, c], dtype)
    finish(cupy, a, [b, c], 0.5, dtype)
    finish(cupy, a, [], 0.5, dtype)
