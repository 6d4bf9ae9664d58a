"""The device kernels' code, checked without a GPU: each one is wrapped the way cupy's
ElementwiseKernel wraps it (inputs as const values, outputs as references) and compiled
with NVRTC for Hopper. Skipped where NVRTC or the CUDA headers are missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from commd.engines.cuda.kernels import KERNELS, spec

cupy = pytest.importorskip("cupy")

C_TYPES = {"float16": "float16", "float32": "float", "float64": "double",
           "uint16": "unsigned short"}
DTYPES = ("float16", "float32", "float64", "bfloat16")


def include_dirs() -> list[str]:
    found = [str(Path(cupy.__file__).parent / "_core" / "include")]
    candidates = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    try:
        import nvidia.cuda_runtime as runtime_wheel

        candidates += list(runtime_wheel.__path__)
    except ImportError:
        pass
    for root in candidates:
        if root and Path(root, "include", "cuda_fp16.h").exists():
            return [*found, str(Path(root, "include"))]
    pytest.skip("no CUDA headers (cuda_fp16.h) here")


def nvrtc() -> object:
    from cupy.cuda import nvrtc as module

    try:
        module.getVersion()
    except Exception as exc:
        pytest.skip(f"NVRTC is not available: {exc}")
    return module


def source(name: str, dtype: str) -> str:
    in_params, out_params, operation, kernel_name, preamble = spec(name, dtype)
    params, bindings = [], []
    for declarations, output in ((in_params, False), (out_params, True)):
        for declaration in declarations.split(","):
            kind, variable = declaration.split()
            params.append(f"{C_TYPES[kind]}* {variable}_")
            bindings.append(f"{C_TYPES[kind]}& {variable} = {variable}_[i];" if output else
                            f"const {C_TYPES[kind]} {variable} = {variable}_[i];")
    return (f"#include <cupy/float16.cuh>\n{preamble}\n"
            f'extern "C" __global__ void {kernel_name}({", ".join(params)}, int n) {{\n'
            f"  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
            f"  if (i < n) {{ {' '.join(bindings)} {operation} }}\n}}\n")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_compiles(dtype: str) -> None:
    compiler = nvrtc()
    options = [*(f"-I{d}" for d in include_dirs()), "-std=c++17", "--gpu-architecture=compute_90"]
    for name in KERNELS:
        program = compiler.createProgram(source(name, dtype), f"{name}.cu", [], [])  # type: ignore[attr-defined]
        try:
            compiler.compileProgram(program, options)  # type: ignore[attr-defined]
        except Exception as exc:
            log = compiler.getProgramLog(program)  # type: ignore[attr-defined]
            pytest.fail(f"{name} ({dtype}) does not compile: {exc}\n{log}")
        finally:
            compiler.destroyProgram(program)  # type: ignore[attr-defined]


def test_unknown_kernel() -> None:
    with pytest.raises(ValueError, match="no kernel 'mul'"):
        spec("mul", "float32")
