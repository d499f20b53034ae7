"""Compile kernel sources with NVRTC on any machine, GPU or not: the pip packages `nvidia-cuda-nvrtc`
and `nvidia-cuda-runtime` (13) carry the compiler and the CUDA headers. Tests compile every kernel
for the GPUs MLX's CUDA build runs on, so a typo fails here rather than on the GPU, and the
compiler's resource report (registers, spills) is there to read.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path
from typing import Optional


class CompileError(RuntimeError):
    pass


def _nvidia_root() -> Optional[Path]:
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations if spec else []) or []:
        root = Path(base) / "cu13"
        if (root / "include" / "cuda_bf16.h").exists() and list((root / "lib").glob("libnvrtc.so*")):
            return root
    return None


def available() -> bool:
    return _nvidia_root() is not None


_lib = None


def _nvrtc():
    global _lib
    if _lib is None:
        root = _nvidia_root()
        if root is None:
            raise CompileError("NVRTC not found: pip install 'nvidia-cuda-nvrtc==13.*' 'nvidia-cuda-runtime==13.*'")
        _lib = ctypes.CDLL(str(sorted((root / "lib").glob("libnvrtc.so*"))[0]))
    return _lib


def compile_source(source: str, arch: str = "sm_90a", name: str = "kernel.cu",
                   verbose: bool = False) -> tuple[bytes, str]:
    """(cubin, compiler log) of `source` for `arch` (MLX's options: the device as default execution
    space; a cubin, so ptxas checks the inline assembly too). `verbose`: ptxas's resource report in
    the log. Raises CompileError with the log."""
    lib, root = _nvrtc(), _nvidia_root()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None))
    try:
        options = ["--device-as-default-execution-space", f"--gpu-architecture={arch}",
                   f"--include-path={root / 'include'}", *(["--ptxas-options=-v"] if verbose else [])]
        args = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), args)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if status != 0:
            raise CompileError(f"{name} ({arch}):\n{text}")
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin))
        return cubin.raw, text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(lib, status: int) -> None:
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CompileError(lib.nvrtcGetErrorString(status).decode())
