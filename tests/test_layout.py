"""The package layout: each subpackage a layer, imports running one way, the old module paths kept."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_mtp.runtime.moved import MOVED

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_mtp"
# Bottom first: a module imports only from its own layer and the layers before it. Named by the
# longest matching prefix; the cache package's __init__ and its KV cache sit below the models (which
# write it), its prefix cache above them (its disk tier records which kernels made a state).
LAYERS = [
    ["runtime"], ["kernels"], ["cache.kv", "cache.__init__"], ["models"], ["formats"], ["cache"],
    ["decode"], ["loading"], ["demo"], ["cli"], ["distributed"], ["learn"], ["store"], ["engine"], ["server"],
    ["chat", "chat_images", "selftest", "__main__", "__init__"],
]
# Imports inside a function that may reach up, each with its reason (none now: the media towers are
# `loading.Tower`s, found through the models' registry, which formats' encoders are handed).
UPWARD: dict = {}
TOP = {"__init__.py", "__main__.py", "chat.py", "chat_images.py", "cli.py", "loading.py",
       "cache", "decode", "demo", "distributed", "engine", "formats", "kernels", "learn", "models",
       "runtime", "selftest", "server", "store"}


def modules() -> dict:
    """'decode.batch' -> its file, for every module under mlx_mtp/ ('cache.__init__' for a package's)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        out[".".join(path.relative_to(PACKAGE).with_suffix("").parts)] = path
    return out


def layer(name: str) -> int:
    best = None
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (i, prefix)
    assert best is not None, f"mlx_mtp.{name} is in no layer: add it to LAYERS"
    return best[0]


def imports(name: str, path: Path, known: set):
    """(imported module, lazy) for every mlx_mtp import in one file, relative ones resolved."""
    tree = ast.parse(path.read_text())
    package = name.rsplit(".", 1)[0] if "." in name else ""
    if name.endswith("__init__"):
        package = name[: -len(".__init__")] if "." in name else ""
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        lazy = id(node) not in top
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(parts + ([node.module] if node.module else []))
            elif node.module and (node.module + ".").startswith("mlx_mtp."):
                base = node.module[len("mlx_mtp."):] if node.module != "mlx_mtp" else ""
            else:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                yield (sub if sub in known or f"{sub}.__init__" in known else base), lazy
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mlx_mtp."):
                    yield alias.name[len("mlx_mtp."):], lazy


def graph():
    mods = modules()
    known = set(mods)
    return {name: [(t, lazy) for t, lazy in imports(name, path, known) if t] for name, path in mods.items()}


def test_the_top_of_the_package_holds_the_layers_and_the_entry_points_only():
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries == TOP
    assert not {f"{old}.py" for old in MOVED} & entries  # no shim files: the old paths live in runtime/moved.py


def test_every_module_imports_only_from_its_layer_or_below():
    upward = []
    for name, targets in graph().items():
        for target, lazy in targets:
            if layer(target) > layer(name) and not (lazy and (name, target) in UPWARD):
                where = " (in a function)" if lazy else ""
                upward.append(f"mlx_mtp.{name} imports mlx_mtp.{target}{where}")
    assert upward == []


def test_the_module_imports_have_no_cycle():
    edges = {}
    for name, targets in graph().items():
        name = name.removesuffix(".__init__")
        edges[name] = {t.removesuffix(".__init__") for t, lazy in targets if not lazy} - {name}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [node, dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_layer_check_catches_an_import_upward(tmp_path):
    # the check itself can fail: the engine's import of the driver read backwards is one arrow up
    known = set(modules())
    path = tmp_path / "batch.py"
    path.write_text("from ..engine.worker import Worker\n")
    targets = list(imports("decode.batch", path, known))
    assert targets == [("engine.worker", False)] and layer("engine.worker") > layer("decode.batch")


OLD_PATHS = """
import importlib, json, sys, warnings
import mlx_mtp
out = {}
for old, new in json.loads(sys.argv[1]).items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("mlx_mtp." + old)
        again = importlib.import_module("mlx_mtp." + old)
    out[old] = {"same": module is importlib.import_module("mlx_mtp." + new) and again is module,
                "warnings": [str(w.message) for w in caught if w.category is DeprecationWarning],
                "spec": module.__spec__.name}
print(json.dumps(out))
"""


def test_every_old_module_path_gives_the_moved_module_with_one_deprecation_warning():
    res = subprocess.run([sys.executable, "-c", OLD_PATHS, json.dumps(MOVED)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for old, new in MOVED.items():
        assert out[old] == {"same": True, "spec": f"mlx_mtp.{new}",
                            "warnings": [f"mlx_mtp.{old} is now mlx_mtp.{new}; import it from there"]}, old


def test_old_paths_through_the_package_and_its_function_named_generate():
    code = """
import warnings
warnings.filterwarnings("error", message=".* is now mlx_mtp")
import mlx_mtp
from mlx_mtp.cache import KVCache
from mlx_mtp.engine import Engine
from mlx_mtp.learn import Learner, adapt
from mlx_mtp.selftest import main
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    stats = mlx_mtp.stats
    from mlx_mtp.generate import generate_tokens
import mlx_mtp.decode.stats, mlx_mtp.cache.kv, mlx_mtp.learn.learner, mlx_mtp.decode.generate
assert stats is mlx_mtp.decode.stats and KVCache is mlx_mtp.cache.kv.KVCache
assert Learner is mlx_mtp.learn.learner.Learner and Engine is mlx_mtp.Engine
assert callable(mlx_mtp.generate) and mlx_mtp.generate is mlx_mtp.decode.generate.generate
print(len(caught), caught[0].filename == "<string>")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["2", "True"]  # each old path warned once, at the line that used it


# what `import mlx_mtp` loaded of mlx_mtp before the layers (`mlx_mtp.X`)
BEFORE = """admission batch cache chat_format conversation conversations drafters engine generate grammar
history images jit kernels kernels.attn_input kernels.dispatch kernels.ffn kernels.glue kernels.qmm
kernels.sdpa kernels.source loading lockstep memory mlx_build models models.base models.quantized
output prefill prefix_cache prefix_disk prepare processors requests row sample speculative stats
text threads vision worker""".split()
# modules written after the move (issue 42's router kernel; issue 49's split of formats.chat; issue 50's
# audio), imported as their siblings are
ADDED_SINCE = ["kernels.routing", "formats.markup", "formats.toolcall", "formats.media", "formats.audio",
               "formats.dataurl"]


def test_import_mlx_mtp_loads_no_module_it_did_not_load_before_the_layers():
    code = "import json, sys, mlx_mtp; print(json.dumps([m for m in sys.modules if m.startswith('mlx_mtp')]))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    renamed = {**MOVED, "cache": "cache.kv", "engine": "engine.engine"}
    now = {f"mlx_mtp.{renamed.get(old, old)}" for old in BEFORE + ADDED_SINCE}
    packages = {f"mlx_mtp.{p}" for p in ("cache", "decode", "engine", "formats", "runtime")}  # __init__s
    assert set(json.loads(res.stdout)) <= now | packages | {"mlx_mtp", "mlx_mtp.runtime.moved"}


@pytest.mark.parametrize("command", [["-m", "mlx_mtp.learn", "--help"], ["-m", "mlx_mtp.selftest", "--help"]])
def test_the_python_m_commands_of_the_packages_still_run(command):
    res = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: python -m {command[1]} ")
