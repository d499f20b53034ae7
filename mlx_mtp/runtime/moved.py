"""Where mlx_mtp's modules lived before the layer packages, and the import hook that keeps those paths.

`import mlx_mtp.batch` (or `from mlx_mtp.batch import ...`, or `mlx_mtp.batch` after `import mlx_mtp`)
gives the very module at its new path, `mlx_mtp.decode.batch`, so isinstance checks and monkeypatching
reach the code that runs, and warns once (a DeprecationWarning). Old names that a package now carries
(`mlx_mtp.cache`, `.engine`, `.learn`, `.selftest`) are not here: those packages re-export what the
modules did.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

PACKAGE = __package__.rpartition(".")[0]  # mlx_mtp: the old paths were its modules

MOVED = {  # old module -> where it lives now
    "admission": "engine.admission", "batch": "decode.batch", "capture": "learn.capture",
    "chat_format": "formats.chat", "conversation": "engine.conversation",
    "conversations": "engine.conversations", "distill": "learn.distill", "drafters": "decode.drafters",
    "generate": "decode.generate", "grammar": "decode.grammar", "group": "distributed.group",
    "history": "engine.history", "images": "formats.images", "jit": "runtime.jit",
    "lockstep": "decode.lockstep", "memory": "runtime.memory", "mlx_build": "runtime.mlx_build",
    "oracle": "decode.oracle", "output": "engine.output", "pipeline": "distributed.pipeline",
    "prefill": "decode.prefill", "prefix_cache": "cache.prefix", "prefix_disk": "cache.disk",
    "prepare": "engine.prepare", "primitives": "selftest.primitives", "processors": "decode.processors",
    "quantize": "models.quantize", "requests": "engine.requests", "row": "decode.row",
    "sample": "decode.sample", "speculative": "decode.speculative", "stats": "decode.stats",
    "text": "decode.text", "threads": "runtime.threads", "tiny": "selftest.tiny", "vision": "formats.vision",
    "warm": "selftest.warm", "worker": "engine.worker",
}
SHADOWED = {"generate"}  # `mlx_mtp.generate` is the function; importing the old module must not replace it


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `mlx_mtp.<old>` with the module at its new path (the import system then files it in
    sys.modules under the old name too, so it warns once)."""

    def __init__(self):
        self._specs = {}

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package != PACKAGE or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = f"{PACKAGE}.{MOVED[spec.name.rpartition('.')[2]]}"
        warnings.warn(f"{spec.name} is now {new}; import it from there", DeprecationWarning,
                      stacklevel=_importer_level())
        module = importlib.import_module(new)
        self._specs[new] = module.__spec__
        return module

    def exec_module(self, module):
        # the import system set the old name's spec on the module: give it back its own
        module.__spec__ = self._specs.pop(module.__name__, module.__spec__)


class Package(types.ModuleType):
    """mlx_mtp's own module type: an old module imported by name does not replace a function of the
    same name (`mlx_mtp.generate`)."""

    def __setattr__(self, name, value):
        if name in SHADOWED and isinstance(value, types.ModuleType) and name in self.__dict__:
            return
        super().__setattr__(name, value)


def install(package: types.ModuleType) -> None:
    """Keep the old paths of `package` (mlx_mtp) importable; once per process."""
    package.__class__ = Package
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.append(Finder())


def old_attribute(name: str):
    """`mlx_mtp.<old>` after `import mlx_mtp`, as it worked while `mlx_mtp` imported every module."""
    if name not in MOVED:
        raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")
    return importlib.import_module(f"{PACKAGE}.{name}")


def _importer_level() -> int:
    """The `stacklevel` that names the line with the import: frames of the import system (which the
    warnings module does not count) and of this hook skipped."""
    level, frame = 1, sys._getframe(1)  # `create_module`: stacklevel 1
    while frame.f_back is not None:
        frame = frame.f_back
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            continue
        level += 1
        ours = name == __file__ or frame.f_globals.get("__name__") == PACKAGE
        if not ours and "importlib" not in name:
            return level
    return level
