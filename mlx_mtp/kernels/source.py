"""CUDA kernels as MLX sees them: a header of device code beside this file, a one-line body that
calls it, and `mx.fast.cuda_kernel` to compile (NVRTC, on first use) and launch them.

`Kernel` makes MLX's kernel object once and launches it; `use_factory` swaps `mx.fast.cuda_kernel`
for another with its signature (tests run the kernels on the CPU through an emulator that way).
`full_source` writes out the translation unit MLX builds for a launch (its `build_kernel`), so that
NVRTC can compile every kernel on a machine without a GPU (`nvrtc.py`).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx

HERE = Path(__file__).resolve().parent


def compact(source: str) -> str:
    """`source` without comments and blank lines: MLX hashes a kernel's whole source at every launch
    (its compiled-module key), so the text it is handed is kept short."""
    lines = (line.split("//", 1)[0].rstrip() for line in source.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


PRELUDE = compact((HERE / "prelude.cuh").read_text())

_factory: Callable = mx.fast.cuda_kernel


@contextlib.contextmanager
def use_factory(factory: Callable) -> Iterator[None]:
    """Within the block kernels are made by `factory` (mx.fast.cuda_kernel's signature)."""
    global _factory
    before, _factory = _factory, factory
    Kernel.made.clear()
    try:
        yield
    finally:
        _factory = before
        Kernel.made.clear()


class Kernel:
    """One kernel: `body` (the function body MLX wraps, usually one call of a template in `header`)
    with named inputs and outputs; launched with template arguments, a grid and a block."""

    made: dict = {}  # (name, factory) -> the factory's kernel object, made once per process

    def __init__(self, name: str, header, inputs: Sequence[str], outputs: Sequence[str], body: str,
                 shared_memory: int = 0):
        """`header`: a header's file name beside this one, a sequence of them (in include order), or None."""
        self.name, self.inputs, self.outputs, self.body = name, tuple(inputs), tuple(outputs), body
        headers = [header] if isinstance(header, str) else list(header or [])
        self.header = PRELUDE + "".join(compact((HERE / h).read_text()) for h in headers)
        self.shared_memory = shared_memory

    def __call__(self, inputs: Sequence[mx.array], template: list, grid: tuple, threadgroup: tuple,
                 output_shapes: Sequence[tuple], output_dtypes: Sequence[mx.Dtype], init_value=None) -> list:
        key = (self.name, id(_factory))
        kernel = self.made.get(key)
        if kernel is None:
            kernel = self.made[key] = _factory(name=self.name, input_names=list(self.inputs),
                                               output_names=list(self.outputs), source=self.body,
                                               header=self.header, ensure_row_contiguous=True,
                                               shared_memory=self.shared_memory)
        more = {} if init_value is None else {"init_value": init_value}  # every output filled with it first
        return kernel(inputs=list(inputs), template=template, grid=grid, threadgroup=threadgroup,
                      output_shapes=list(output_shapes), output_dtypes=list(output_dtypes), **more)

    def full_source(self, input_dtypes: Sequence[mx.Dtype], output_dtypes: Sequence[mx.Dtype], template: list,
                    default_header: Optional[str] = None) -> str:
        """The translation unit MLX compiles for a launch with these dtypes and template arguments
        (mlx/backend/cuda/custom_kernel.cpp, `build_kernel`), its default header replaced by
        `default_header` (None: `STAND_IN`, what the kernels need of MLX's)."""
        params = []
        for name, dtype in zip(self.inputs, input_dtypes):
            params.append(f"    const {CTYPES[dtype]}* {name}")
            for suffix, kind in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
                if re.search(rf"\b{name}_{suffix}\b", self.body):
                    params.append(f"    const __grid_constant__ {kind} {name}_{suffix}")
        params += [f"    {CTYPES[dtype]}* {name}" for name, dtype in zip(self.outputs, output_dtypes)]
        constants = []
        for name, value in template:
            if isinstance(value, bool):
                constants.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
            elif isinstance(value, int):
                constants.append(f"  constexpr int {name} = {value};")
            else:
                constants.append(f"  using {name} = {CTYPES[value]};")
        return "\n".join([STAND_IN if default_header is None else default_header, self.header,
                          "namespace mlx::core::cu {", "namespace cg = cooperative_groups;",
                          f"__global__ void custom_kernel_{self.name}(", ",\n".join(params) + ") {",
                          *constants, self.body, "}", "}  // namespace mlx::core::cu", ""])


CTYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint32: "uint32_t",
          mx.int32: "int32_t", mx.uint8: "uint8_t", mx.int8: "int8_t", mx.uint16: "uint16_t",
          mx.int16: "int16_t", mx.int64: "int64_t", mx.uint64: "uint64_t", mx.bool_: "bool"}

# What kernel sources see of MLX's default header (mlx/backend/cuda/device/utils.cuh and the
# libcu++ headers it includes): the CUDA half-precision types, the fixed-width integers, and the
# Shape / Strides of kernel parameters (there cuda::std::arrays of 10, read here by index only).
STAND_IN = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef int int32_t;
typedef unsigned int uint32_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
namespace cooperative_groups {}  // (the real header's; no kernel here uses it)
namespace mlx::core::cu {
template <typename I> struct StandInArray {
  I v[10];
  __device__ const I& operator[](int i) const { return v[i]; }
};
using Shape = StandInArray<int32_t>;
using Strides = StandInArray<int64_t>;
}  // namespace mlx::core::cu
"""
