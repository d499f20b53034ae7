"""An install ends with exactly one MLX build, as a user meets it: pip with stand-in wheels of MLX's
(`mlx`, `mlx-cpu`, `mlx-cuda-13`, the last two writing the same library file), our setup.py's
choice of build, both orders in which an environment can come to hold two builds, and the one-line
fix mlx_mtp prints; and that line, not a traceback, from every command when MLX cannot load."""

import base64
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from mlx_mtp.runtime import mlx_build

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.32.4"
LIBRARY = "mlx/lib/libmlx.so"


def wheel(where: Path, name: str, files: dict, requires=(), extras=None) -> None:
    """A py3-none-any wheel of `name` holding `files` (path -> bytes)."""
    stem = f"{name.replace('-', '_')}-{VERSION}"
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {VERSION}\n"]
    meta += [f"Requires-Dist: {r}\n" for r in requires]
    for extra, reqs in (extras or {}).items():
        meta += [f"Provides-Extra: {extra}\n", *(f'Requires-Dist: {r}; extra == "{extra}"\n' for r in reqs)]
    files = {**files, f"{stem}.dist-info/METADATA": "".join(meta).encode(),
             f"{stem}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for path, data in files.items()]
    with zipfile.ZipFile(where / f"{stem}-py3-none-any.whl", "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{stem}.dist-info/RECORD", "\n".join(record + [f"{stem}.dist-info/RECORD,,"]) + "\n")


def ours():
    spec = importlib.util.spec_from_file_location("mlx_mtp_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: setup() is not called
    return module


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A venv and MLX's stand-in wheels."""
    base = tmp_path_factory.mktemp("install")
    wheels = base / "wheels"
    wheels.mkdir()
    wheel(wheels, "mlx", {"mlx/bindings.txt": b"bindings"},
          extras={"cpu": [f"mlx-cpu=={VERSION}"], "cuda13": [f"mlx-cuda-13=={VERSION}"]})
    wheel(wheels, "mlx-cpu", {LIBRARY: b"cpu"})
    wheel(wheels, "mlx-cuda-13", {LIBRARY: b"cuda"})
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    return dict(base=base, wheels=wheels, python=str(venv / "bin" / "python"))


def pip(env, *args):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    out = subprocess.run([env["python"], "-m", "pip", "-q", "--disable-pip-version-check", *args], env=environ,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stderr


def install(env, backend: str, extra: str = "") -> None:
    """`pip install .{extra}` as setup.py and pyproject.toml would have it with MLX_MTP_BACKEND=backend, reduced
    to what they ask of MLX (the rest would need the network): our package as a wheel of that metadata."""
    mlx = lambda reqs: [r for r in reqs if re.match(r"mlx\b(?!-)", r)]  # noqa: E731  (not mlx-lm)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    where = env["base"] / f"ours-{backend}"
    where.mkdir(exist_ok=True)
    wheel(where, "mlx-mtp", {"mlx_mtp_standin.txt": b""}, mlx(ours().dependencies({"MLX_MTP_BACKEND": backend})),
          {k: mlx(v) for k, v in extras.items()})
    pip(env, "install", "--no-index", "--find-links", str(env["wheels"]), "--find-links", str(where),
        "--force-reinstall", f"mlx-mtp{extra}")


def builds(env) -> tuple:
    """(the MLX builds installed, the library file's content)."""
    code = ("import importlib.metadata as m, pathlib\n"
            "names = sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'] in "
            "('mlx-cpu', 'mlx-cuda-13'))\n"
            "lib = next((p for p in map(pathlib.Path, __import__('sys').path) if (p / 'mlx/lib/libmlx.so').exists()), None)\n"
            "print(','.join(names), (lib / 'mlx/lib/libmlx.so').read_text() if lib else '-')")
    names, library = subprocess.run([env["python"], "-c", code], capture_output=True, text=True,
                                    check=True).stdout.split()
    return tuple(names.split(",")) if names else (), library


def fix(env, driver: Path):
    """Run the line mlx_mtp prints, offline (the stand-in wheels as the index)."""
    line = mlx_build.fix_line(driver)
    uninstall, install_one = line.split(" && ")
    pip(env, *uninstall.split()[1:])
    pip(env, "install", "--no-index", "--find-links", str(env["wheels"]), install_one.split("'")[1].split("==")[0])


@pytest.mark.skipif(sys.platform != "linux", reason="the build choice is Linux's")
def test_each_install_command_ends_with_one_build_and_the_fix_line_mends_two(env, tmp_path):
    install(env, "cpu")
    assert builds(env) == (("mlx-cpu",), "cpu")
    install(env, "cpu", "[cuda]")  # the README's old NVIDIA command: no extra adds a second build any more
    assert builds(env) == (("mlx-cpu",), "cpu")
    install(env, "cuda")  # an environment switched over: both, CUDA's library written last
    assert builds(env) == (("mlx-cpu", "mlx-cuda-13"), "cuda")
    fix(env, tmp_path / "no-driver")
    assert builds(env) == (("mlx-cpu",), "cpu")
    install(env, "cuda")
    install(env, "cpu")  # the other order: CPU's library written last
    assert builds(env)[0] == ("mlx-cpu", "mlx-cuda-13")
    driver = tmp_path / "version"
    driver.write_text("NVRM version: 580.95")
    fix(env, driver)
    assert builds(env) == (("mlx-cuda-13",), "cuda")


@pytest.fixture
def cuda_without_driver(tmp_path):
    """An `mlx` whose core fails to load as MLX's CUDA build does on a machine with no driver."""
    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / "__init__.py").write_text("")
    (tmp_path / "mlx" / "core.py").write_text(
        "raise ImportError('libcuda.so.1: cannot open shared object file: No such file or directory')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


@pytest.mark.parametrize("command", [["mlx_mtp.selftest"], ["mlx_mtp.chat", "--help"], ["mlx_mtp.server", "--help"],
                                     ["convert", "--help"], ["apps.bench", "gpu", "--smoke"]])
def test_every_command_says_in_one_line_how_to_fix_an_mlx_that_cannot_load(cuda_without_driver, command):
    out = subprocess.run([sys.executable, "-m", *command], env=cuda_without_driver, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("mlx_mtp: MLX cannot load (libcuda.so.1: cannot open shared object file")
    assert lines[0].endswith(mlx_build.fix_line())


@pytest.mark.parametrize("command", [["mlx_mtp.server"], ["mlx_mtp.chat"], ["mlx_mtp.selftest"]])
def test_without_mlx_installed_every_command_says_how_to_install_it(command):
    """`sys.modules["mlx"] = None`: `import mlx` fails as it does where no MLX is installed."""
    run = f"import runpy, sys; sys.modules['mlx'] = None; runpy.run_module({command[0]!r}, run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", run, *command[1:]], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == f"mlx_mtp: MLX is not installed: {mlx_build.install_line()}", out.stderr
