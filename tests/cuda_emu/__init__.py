"""A CPU stand-in for `mx.fast.cuda_kernel`, so tests can run the project's CUDA kernels without a GPU.

`cuda_kernel(...)` takes MLX's arguments and returns a callable with MLX's call signature. A call
builds the kernel source the way MLX does (mlx/backend/cuda/custom_kernel.cpp), with the prelude
(mlx_mtp/kernels/prelude.cuh) swapped for `emulate.h`, adds a `main` that runs every block on the
CPU, compiles it with g++ and AddressSanitizer/UBSan (binaries cached by a hash of source and flags)
and runs it in a subprocess. Out-of-bounds accesses, deadlocked barriers and the like raise
`CudaEmuError` with the sanitizer's or emulator's report.

Differences from a GPU: inputs are always passed row-contiguous (as with ensure_row_contiguous=True);
outputs not covered by `init_value` start as all-0xFF bytes (NaN for floats) and dynamic shared
memory as 0xCD bytes, so reads of unwritten memory show; blocks run one after another.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
PRELUDE_TEXT = (HERE.parents[1] / "mlx_mtp" / "kernels" / "prelude.cuh").read_text()
try:  # the kernels hand MLX their sources without comments (mlx_mtp.kernels.source.compact)
    from mlx_mtp.kernels.source import PRELUDE as COMPACT_PRELUDE
except ImportError:
    COMPACT_PRELUDE = PRELUDE_TEXT
EMULATE_H = (HERE / "emulate.h").read_text()
CXX = os.environ.get("CXX", "g++")
FLAGS = ("-std=c++20", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         "-Wno-unknown-pragmas", "-pthread")
CACHE = Path(os.environ.get("MLX_MTP_CUDA_EMU_CACHE", Path(tempfile.gettempdir()) / "mlx_mtp_cuda_emu"))
# Without the sanitizers: half the cost per launch, for tests that launch thousands of kernels (a model's
# forwards) once the kernels themselves are covered with them.
FAST_FLAGS = ("-std=c++20", "-O1", "-Wno-unknown-pragmas", "-pthread")
RUN_TIMEOUT_S = 600
MAX_DYNAMIC_SHARED = 227 * 1024  # sm_90's opt-in limit per block
# Leaks are not kernel bugs (and LeakSanitizer fails under ptrace); everything else stops the run.
SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
# Printed on the first fiber switch; emulate.h annotates its fibers, so it is only noise.
NOISE = "ASan doesn't fully support makecontext/swapcontext"

# dtype -> (CUDA C type, numpy dtype of its bytes, MLX's type string in kernel names)
TYPES = {
    mx.float32: ("float", np.float32, "float"),
    mx.float16: ("__half", np.float16, "float16_t"),
    mx.bfloat16: ("__nv_bfloat16", np.uint16, "bfloat16_t"),
    mx.uint8: ("uint8_t", np.uint8, "uint8_t"),
    mx.uint16: ("uint16_t", np.uint16, "uint16_t"),
    mx.uint32: ("uint32_t", np.uint32, "uint32_t"),
    mx.uint64: ("uint64_t", np.uint64, "uint64_t"),
    mx.int8: ("int8_t", np.int8, "int8_t"),
    mx.int16: ("int16_t", np.int16, "int16_t"),
    mx.int32: ("int32_t", np.int32, "int32_t"),
    mx.int64: ("int64_t", np.int64, "int64_t"),
    mx.bool_: ("bool", np.bool_, "bool"),
}


class CudaEmuError(RuntimeError):
    """The emulated kernel failed to compile, to launch, or to run cleanly."""


def available() -> bool:
    """Whether the C++ compiler the emulator needs is installed."""
    return shutil.which(CXX) is not None


def cuda_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                shared_memory=0):
    """Drop-in for `mx.fast.cuda_kernel`, running on the CPU. `ensure_row_contiguous` is accepted but
    the inputs are always passed row-contiguous (their data only reach the CPU through numpy)."""
    if not output_names:
        raise ValueError("[custom_kernel] Must specify at least one output.")
    return Kernel(name, list(input_names), list(output_names), source, header, shared_memory)


def cuda_kernel_fast(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                     shared_memory=0):
    """`cuda_kernel` built without the sanitizers (FAST_FLAGS)."""
    kernel = cuda_kernel(name, input_names, output_names, source, header, ensure_row_contiguous, shared_memory)
    kernel.flags = FAST_FLAGS
    return kernel


def _type(dtype):
    if dtype not in TYPES:
        raise ValueError(f"[cuda_emu] unsupported dtype {dtype}")
    return TYPES[dtype]


def _to_bytes(a: mx.array) -> bytes:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


def _from_bytes(data: bytes, shape, dtype) -> mx.array:
    a = mx.array(np.frombuffer(data, dtype=_type(dtype)[1]).reshape(shape))
    return a.view(mx.bfloat16) if dtype == mx.bfloat16 else a


def _template_hash(template) -> str:  # MLX's template_arguments_hash
    parts = []
    for _, v in template:
        if isinstance(v, bool):
            parts.append("_t" if v else "_f")
        elif isinstance(v, int):
            parts.append(f"_{v}")
        else:
            parts.append("_" + _type(v)[2])
    return "".join(parts)


def _template_lines(template) -> str:
    lines = []
    for n, v in template:
        if isinstance(v, bool):
            lines.append(f"  constexpr bool {n} = {'true' if v else 'false'};\n")
        elif isinstance(v, int):
            lines.append(f"  constexpr int {n} = {v};\n")
        elif isinstance(v, mx.Dtype):
            lines.append(f"  using {n} = {_type(v)[0]};\n")
        else:
            raise ValueError("[custom_kernel] Invalid template argument. "
                             "Must be `mlx.core.Dtype`, `int` or `bool`.")
    return "".join(lines) + "\n" if lines else ""


class Kernel:
    def __init__(self, name, input_names, output_names, source, header, shared_memory):
        self.name, self.input_names, self.output_names = name, input_names, output_names
        self.source, self.header, self.shared_memory = source, header, shared_memory
        self.flags = FLAGS

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None):
        for what, got, want in (("inputs", inputs, self.input_names),
                                ("output_shapes", output_shapes, self.output_names),
                                ("output_dtypes", output_dtypes, self.output_names)):
            if len(got) != len(want):
                raise ValueError(f"[custom_kernel] Expected `{what}` to have size {len(want)} "
                                 f"but got size {len(got)}.")
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        template = list(template or [])
        func = "custom_kernel_" + self.name + _template_hash(template)
        code = self.generate(func, inputs, output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{func}`:\n```\n{code}\n```")
        launch = self.launch_numbers(inputs, output_shapes, output_dtypes, grid, threadgroup)
        exe = build(code, func, self.flags)
        with tempfile.TemporaryDirectory(prefix="cuda_emu_") as tmp:
            d = Path(tmp)
            (d / "launch.txt").write_text(" ".join(map(str, launch)) + "\n")
            for i, x in enumerate(inputs):
                (d / f"in{i}.bin").write_bytes(_to_bytes(x))
            for i, (shape, dtype) in enumerate(zip(output_shapes, output_dtypes)):
                start = (_to_bytes(mx.full(shape, init_value, dtype)) if init_value is not None
                         else b"\xff" * (math.prod(shape) * dtype.size))  # poison: unwritten shows
                (d / f"out{i}.bin").write_bytes(start)
            run(exe, d, func)
            return [_from_bytes((d / f"out{i}.bin").read_bytes(), s, t)
                    for i, (s, t) in enumerate(zip(output_shapes, output_dtypes))]

    def generate(self, func, inputs, output_dtypes, template) -> str:
        """The kernel as MLX's build_kernel writes it (emulate.h for its default header), plus main()."""
        params, args = [], []
        for i, (n, x) in enumerate(zip(self.input_names, inputs)):
            ctype = _type(x.dtype)[0]
            params.append(f"    const {ctype}* {n}")
            args.append(f"launch.input<{ctype}>({i})")
            for suffix, ptype, arg in (("_shape", "Shape", f'launch.shape({i}, "{n}_shape")'),
                                       ("_strides", "Strides", f'launch.strides({i}, "{n}_strides")'),
                                       ("_ndim", "int", f"launch.ndim({i})")):
                if x.ndim > 0 and n + suffix in self.source:
                    params.append(f"    const __grid_constant__ {ptype} {n}{suffix}")
                    args.append(arg)
        for i, (n, dtype) in enumerate(zip(self.output_names, output_dtypes)):
            params.append(f"    {_type(dtype)[0]}* {n}")
            args.append(f"launch.output<{_type(dtype)[0]}>({i})")
        header = self.header.replace(PRELUDE_TEXT, '#include "emulate.h"\n').replace(
            COMPACT_PRELUDE, '#include "emulate.h"\n')
        locals_ = "".join(f"  auto arg{i} = {a};\n" for i, a in enumerate(args))
        call = ", ".join(f"arg{i}" for i in range(len(args)))
        return (f'#include "emulate.h"\n{header}'
                "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
                f"__global__ void {func}(\n" + ",\n".join(params) + ") {\n"
                f"{_template_lines(template)}{self.source}\n}}\n\n}} // namespace mlx::core::cu\n\n"
                f"int main(int argc, char** argv) {{\n  mtp_emu::Launch launch(argc, argv);\n{locals_}"
                f"  auto kernel = [&] {{ mlx::core::cu::{func}({call}); }};\n"
                f"  launch.run(kernel);\n  return launch.finish();\n}}\n")

    def launch_numbers(self, inputs, output_shapes, output_dtypes, grid, threadgroup) -> list[int]:
        """launch.txt's integers (see mtp_emu::Launch); checks the launch as CUDA would."""
        grid, threadgroup = tuple(map(int, grid)), tuple(map(int, threadgroup))
        if len(grid) != 3 or len(threadgroup) != 3 or min(grid + threadgroup) < 1:
            raise ValueError(f"[cuda_emu] grid {grid} and threadgroup {threadgroup}: need 3 positive sizes")
        block = [min(t, g) for t, g in zip(threadgroup, grid)]  # as MLX launches
        blocks = [-(-g // t) for g, t in zip(grid, threadgroup)]
        if math.prod(block) > 1024 or block[2] > 64 or max(blocks[1:]) > 65535:
            raise CudaEmuError(f"invalid launch: {blocks} blocks of {block} threads")
        if self.shared_memory > MAX_DYNAMIC_SHARED:
            raise CudaEmuError(f"invalid launch: {self.shared_memory} bytes of dynamic shared memory")
        numbers = [*blocks, *block, self.shared_memory, len(inputs), len(output_shapes)]
        for x in inputs:
            strides = [math.prod(x.shape[i + 1:]) for i in range(x.ndim)]
            numbers += [x.nbytes, x.ndim, *x.shape, *strides]
        numbers += [math.prod(s) * t.size for s, t in zip(output_shapes, output_dtypes)]
        return numbers


def _compile(args: list[str], what: str, flags: tuple, stdin: str | None = None) -> None:
    r = subprocess.run([CXX, *flags, "-I", str(HERE), *args], input=stdin, capture_output=True, text=True)
    if r.returncode:
        raise CudaEmuError(f"compiling {what} failed:\n{r.stderr[-20000:]}")


def _runtime(flags: tuple) -> Path:
    """emulate.h's runtime part, compiled once into an object that every kernel links."""
    key = hashlib.sha256("\0".join([EMULATE_H, CXX, *flags]).encode()).hexdigest()[:32]
    obj = CACHE / f"runtime-{key}.o"
    if not obj.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = obj.with_suffix(f".{os.getpid()}.tmp")
        _compile(["-x", "c++", "-c", "-", "-o", str(tmp)], "emulate.h's runtime", flags,
                 stdin='#define MTP_EMU_IMPLEMENTATION\n#include "emulate.h"\n')
        os.replace(tmp, obj)  # renamed when complete: concurrent builds never see half a file
    return obj


def build(code: str, func: str, flags: tuple = FLAGS) -> Path:
    """Compiles `code` once per distinct (source, emulate.h, flags); returns the executable."""
    key = hashlib.sha256("\0".join([code, EMULATE_H, CXX, *flags]).encode()).hexdigest()[:32]
    exe = CACHE / key / "kernel"
    if exe.exists():
        return exe
    runtime = _runtime(flags)
    exe.parent.mkdir(parents=True, exist_ok=True)
    src = exe.parent / "kernel.cpp"
    src.write_text(code)
    tmp = exe.with_suffix(f".{os.getpid()}.tmp")
    _compile([str(src), str(runtime), "-o", str(tmp)], f"{func} ({src})", flags)
    os.replace(tmp, exe)
    return exe


def run(exe: Path, workdir: Path, func: str) -> None:
    try:
        r = subprocess.run([str(exe), str(workdir)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                           env={**os.environ, **SANITIZER_ENV})
    except subprocess.TimeoutExpired as e:
        raise CudaEmuError(f"{func} ran over {RUN_TIMEOUT_S} s (source: {exe.parent / 'kernel.cpp'})") from e
    if r.returncode:
        report = "".join(line for line in r.stderr.splitlines(keepends=True) if NOISE not in line)
        raise CudaEmuError(f"{func} failed (exit {r.returncode}; source: {exe.parent / 'kernel.cpp'}):\n"
                           f"{report[-20000:]}")
