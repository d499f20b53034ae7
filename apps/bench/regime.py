"""Benchmark regimes: which BLAS serves MLX's fp32 matmuls (`cblas_sgemm`) on the CPU.

  stock  as installed: on Linux the mlx-cpu wheel's reference BLAS; on macOS MLX's own
         (Metal / Accelerate) paths
  mkl    MKL (`pip install mkl`) loaded in-process before `mlx.core` is imported

(The `streaming` emulation of a bandwidth-bound GPU was removed in issue 38, now that a real GPU is
measured; its figures in apps/README.md came from commit d223093.)

`setup(name)` must run before anything imports `mlx.core`; it loads MKL with RTLD_GLOBAL (so
libmlx.so's undefined `cblas_sgemm` binds to it), imports MLX, and checks which library
libmlx.so's `cblas_sgemm` slot actually points at, failing loudly on a mismatch.
The product never needs any of this; only the benchmarks do.
"""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import platform
import struct
import sys
from pathlib import Path
from typing import Optional

REGIMES = ("stock", "mkl")
# One MKL thread: MLX runs its own (single-threaded) kernels between matmuls, and a second MKL
# thread spins while they run. Measured on the 2-core build box (apps/README.md).
MKL_THREADS = "1"

_state: dict = {}


class RegimeError(RuntimeError):
    """A regime that cannot be set up here, or did not take effect."""


def setup(name: str) -> dict:
    """Load the regime's BLAS, import mlx.core, verify; returns `describe()`. Idempotent for
    the same name; another regime after mlx.core was imported is an error."""
    if name not in REGIMES:
        raise RegimeError(f"unknown regime {name!r} (one of {', '.join(REGIMES)})")
    if _state:
        if _state["name"] != name:
            raise RegimeError(f"regime {_state['name']} is already set up in this process; {name} needs a fresh one")
        return describe()
    if name != "stock" and "mlx.core" in sys.modules:
        raise RegimeError(f"regime {name} must be set up before mlx.core is imported "
                          f"(run `python -m apps.bench ... --regime {name}` in a fresh process)")
    state = {"name": name, "mkl": None, "mkl_threads": None}
    if name == "mkl":
        mkl_path = find_mkl()
        os.environ.setdefault("MKL_NUM_THREADS", MKL_THREADS)
        mkl = ctypes.CDLL(str(mkl_path), mode=os.RTLD_GLOBAL)
        state["mkl"], state["mkl_threads"] = str(mkl_path), mkl.MKL_Get_Max_Threads()
    import mlx_mtp  # noqa: F401  (imports mlx.core: binds libmlx.so's cblas_sgemm; explains an MLX that cannot load)

    _state.update(state)
    _state["provider"] = verify(name)
    return describe()


def child_env() -> dict | None:
    """The environment for a subprocess (a server) to run in this process's regime: MKL
    preloaded for `mkl`; None for stock."""
    if _state.get("name", "stock") == "stock":
        return None
    return dict(os.environ, LD_PRELOAD=_state["mkl"], MKL_NUM_THREADS=str(_state["mkl_threads"]))


def describe() -> dict:
    """The regime as recorded in every report's environment."""
    s = _state or {"name": "stock (not set up)", "mkl": None, "mkl_threads": None, "provider": None}
    return {"name": s["name"], "label": label(), "sgemm_provider": s["provider"], "mkl": s["mkl"],
            "mkl_threads": s["mkl_threads"]}


def label() -> str:
    if _state.get("name") == "mkl":
        return f"mkl (fp32 matmuls on MKL, MKL_NUM_THREADS={_state['mkl_threads']})"
    provider = _state.get("provider")
    if provider:
        return f"stock (fp32 matmuls on the installed BLAS: {Path(provider).name})"
    return "stock (as installed)"


def find_mkl() -> Path:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RegimeError(f"the mkl regime needs Linux x86-64 (this is {platform.system()} "
                          f"{platform.machine()}); use --regime stock")
    found = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so.*")))
    if not found:
        raise RegimeError(f"no libmkl_rt.so.* in {sys.prefix}/lib: `pip install mkl` for the mkl regime")
    return Path(found[-1])


# ---- verification ------------------------------------------------------------------------------


def verify(name: str) -> Optional[str]:
    """The file serving libmlx.so's cblas_sgemm, checked against the regime (None where it
    cannot be read: not an ELF libmlx.so, e.g. macOS)."""
    import mlx.core as mx

    mx.eval(mx.ones((2, 2)) @ mx.ones((2, 2)))  # make sure the symbol is bound
    provider = sgemm_provider()
    if provider is None:
        if name != "stock":
            raise RegimeError(f"cannot verify that regime {name} took effect (libmlx.so not readable)")
        return None
    expected = _state["mkl"] if name == "mkl" else None
    if expected and os.path.realpath(provider) != os.path.realpath(expected):
        raise RegimeError(f"regime {name}: libmlx.so's cblas_sgemm is served by {provider}, not {expected}: "
                          "the preload did not take effect")
    if name == "stock" and "mkl" in Path(provider).name:
        raise RegimeError(f"regime stock, but cblas_sgemm is served by {provider} (LD_PRELOAD?): unset it, or "
                          "use --regime mkl")
    return provider


def sgemm_provider() -> Optional[str]:
    """Path of the library that libmlx.so's GOT slot for cblas_sgemm points into (Linux/ELF)."""
    import mlx.core as mx

    path = Path(mx.__file__).parent / "lib" / "libmlx.so"
    offset = _got_offset(path, b"cblas_sgemm") if path.exists() else None
    if offset is None:
        return None
    libdl = ctypes.CDLL(None)
    handle = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    link_map = ctypes.c_void_p()
    if libdl.dlinfo(ctypes.c_void_p(handle._handle), 2, ctypes.byref(link_map)):  # RTLD_DI_LINKMAP
        return None
    base = ctypes.c_size_t.from_address(link_map.value).value  # link_map.l_addr
    target = ctypes.c_void_p.from_address(base + offset).value

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                    ("saddr", ctypes.c_void_p)]

    info = DlInfo()
    if not libdl.dladdr(ctypes.c_void_p(target), ctypes.byref(info)) or not info.fname:
        return None
    return os.path.realpath(info.fname.decode())


def _got_offset(path: Path, symbol: bytes) -> Optional[int]:
    """Address (relative to the load base) of the relocation slot for `symbol` in an ELF64
    little-endian shared object, or None."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as elf:
        if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
            return None
        shoff, = struct.unpack_from("<Q", elf, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
        for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
            if sh_type != 4 or not link or not entsize:  # SHT_RELA with a symbol table
                continue
            symtab = sections[link]
            strtab = sections[symtab[6]]
            for pos in range(offset, offset + size, entsize):
                r_offset, r_info = struct.unpack_from("<QQ", elf, pos)
                st_name, = struct.unpack_from("<I", elf, symtab[4] + (r_info >> 32) * symtab[9])
                start = strtab[4] + st_name
                if elf[start:start + len(symbol) + 1] == symbol + b"\0":
                    return r_offset
    return None

