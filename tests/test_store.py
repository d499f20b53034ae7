"""The model store (issue 51): listing, pairing, sizes, names, pulls through the real huggingface_hub
client from a Hub faked on the loopback (tests/fake_hub.py), refusals, deletes and the CLI."""

import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from chat_helpers import TINY, write_gemma4_tokenizer
from fake_hub import FakeHub, read_repo
from test_help import option_helps

from apps.serve_load import free_port

import mlx_mtp
from mlx_mtp.store import KVShape, Name, NotFound, PullError, Store
from mlx_mtp.store.checkpoint import Checkpoint
from mlx_mtp.store.cli import Bar
from mlx_mtp.store.cli import main as cli
from mlx_mtp.store.names import family_tag
from mlx_mtp.store.pairing import choose, mismatch
from mlx_mtp.store.pull import bar_class

ROOT = Path(__file__).resolve().parent.parent
REAL = Path(__file__).parent / "fixtures" / "real_configs"
E2B, E2B_DRAFTER = "google/gemma-4-E2B-it", "google/gemma-4-E2B-it-assistant"
TINY_ID = "testorg/tiny"
OLLAMA_KEYS = {"status", "digest", "total", "completed"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The tiny dense pair (with a Gemma 4 tokenizer) on a fake Hub, as Gemma 4 E2B and as testorg/tiny."""
    tok = tmp_path_factory.mktemp("tokenizer")
    write_gemma4_tokenizer(tok)
    target, drafter = {**read_repo(TINY / "target"), **read_repo(tok)}, read_repo(TINY / "drafter")
    repos = {E2B: target, E2B_DRAFTER: drafter, TINY_ID: dict(target), f"{TINY_ID}-assistant": drafter}
    with FakeHub(repos) as hub:
        yield hub


@pytest.fixture(autouse=True)
def hub_env(monkeypatch, tmp_path):
    """huggingface_hub as a user runs it, with a home of its own and no network but the fake Hub."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)


@pytest.fixture(scope="module")
def pulled(hub, tmp_path_factory):
    """`gemma4:e2b` pulled once into a models dir: (that dir, the pull's events)."""
    root = tmp_path_factory.mktemp("pulled") / "models"
    events = []
    Store(root, hf_cache=None, endpoint=hub.url).pull("gemma4:e2b", progress=events.append)
    return root, events


def copy_of(pulled, tmp_path) -> Path:
    shutil.copytree(pulled[0], tmp_path / "models")
    return tmp_path / "models"


def test_a_pull_brings_the_target_with_its_drafter_and_reports_each_step(pulled, hub):
    root, events = pulled
    entry = Store(root, hf_cache=None).resolve("gemma4:e2b")
    assert (entry.name, entry.drafter.name, entry.paired_by) == (E2B, E2B_DRAFTER, "name")
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    downloads = [e for e in events if e.file]
    assert all(e.status == f"downloading {e.digest}" and e.json().keys() == OLLAMA_KEYS for e in downloads)
    last = {e.file: e for e in downloads}
    served = {f"{repo}/{p}": len(c) for repo in (E2B, E2B_DRAFTER) for p, c in hub.repos[repo].items()}
    assert {f: (e.completed, e.total) for f, e in last.items()} == {f: (n, n) for f, n in served.items()}
    assert last[f"{E2B}/model.safetensors"].digest.startswith("sha256:")
    assert all(json.loads(json.dumps(e.json())) == e.json() for e in events)  # NDJSON lines as they are


def test_pulling_again_fetches_nothing(pulled, hub, tmp_path):
    root = copy_of(pulled, tmp_path)
    before = hub.gets(E2B, "model.safetensors")
    events = []
    Store(root, hf_cache=None, endpoint=hub.url).pull("gemma4:e2b", progress=events.append)
    assert hub.gets(E2B, "model.safetensors") == before
    assert events[-1].status == "success"


def test_the_sizes_are_the_tensor_bytes_of_the_files_and_the_kv_facts_the_config(pulled):
    entry = Store(pulled[0], hf_cache=None).resolve(E2B)
    tensors = {part: sum(v.nbytes for f in c.files for v in mx.load(str(f)).values())
               for part, c in (("target", entry.target), ("drafter", entry.drafter))}
    assert (entry.target.bytes, entry.drafter.bytes) == (tensors["target"], tensors["drafter"])
    assert entry.bytes == sum(tensors.values()) and entry.target.tower_bytes == 0
    config = json.loads((TINY / "target" / "config.json").read_text())
    kv = entry.kv
    assert kv.layer_types == tuple(config["layer_types"]) and kv.sliding_window == 8 and kv.context == 512
    assert set(zip(kv.layer_types, kv.kv_heads, kv.head_dims)) == {("sliding_attention", 2, 16),
                                                                   ("full_attention", 1, 32)}
    # per position: 4 sliding layers of 2 heads x 16, 2 full layers of 1 head x 32, K and V, float32
    assert kv.bytes(100) == 100 * 2 * (2 * 32) * 4 + 8 * 4 * (2 * 2 * 16) * 4
    assert entry.target.quantization == "f32" and entry.target.digest.startswith("sha256:")


def test_the_released_configs_give_the_kv_facts_a_pool_sizes_by():
    kv = KVShape.from_config(json.loads((REAL / "google--gemma-4-31B-it" / "config.json").read_text()))
    assert (len(kv.layer_types), kv.sliding_window, kv.context, kv.itemsize) == (60, 1024, 262144, 2)
    assert set(zip(kv.layer_types, kv.kv_heads, kv.head_dims)) == {("sliding_attention", 16, 256),
                                                                   ("full_attention", 4, 512)}
    e2b = KVShape.from_config(json.loads((REAL / "google--gemma-4-E2B-it" / "config.json").read_text()))
    assert len(e2b.layer_types) == 15  # 35 layers, the last 20 reading the K/V of earlier ones


def test_names_and_aliases_resolve_as_ollama_has_them(pulled):
    store = Store(pulled[0], hf_cache=None)
    for name in ["gemma4:e2b", "GEMMA4:E2B", E2B, "google/gemma-4-e2b-it:latest", f"hf.co/{E2B}",
                 "registry.ollama.ai/library/gemma4:e2b", f"{E2B}:LATEST"]:
        assert store.resolve(name).name == E2B, name
    assert store.resolve(E2B).aliases == ("gemma4:e2b",)
    with pytest.raises(NotFound, match=r"^model 'gemma4' not found; near: gemma4:e2b$"):
        store.resolve("gemma4")  # gemma4:latest, which is Ollama's e4b
    with pytest.raises(NotFound, match="MTP drafter"):
        store.resolve(E2B_DRAFTER)
    with pytest.raises(Exception, match="invalid model name"):
        store.resolve("a b:c")
    assert Name.parse("registry.ollama.ai/library/gemma4") == Name("gemma4", "latest")


def test_the_released_repos_get_ollamas_gemma4_tags():
    repos = [d.name.replace("--", "/") for d in REAL.iterdir() if d.is_dir()]
    tags = {repo: family_tag(repo) for repo in repos}
    assert tags["google/gemma-4-31B-it"] == "31b" and tags["google/gemma-4-E2B-it"] == "e2b"
    assert tags["google/gemma-4-26B-A4B-it"] == "26b" and tags["google/gemma-4-12B-it"] == "12b"
    assert tags["google/gemma-4-26B-A4B"] == "26b-pt"
    assert tags["mlx-community/gemma-4-e4b-it-4bit"] == "e4b-4bit"
    assert tags["google/gemma-4-31B-it-qat-q4_0-unquantized"] == "31b-qat-q4_0-unquantized"


def checkpoint(name: str, config: dict, where: str = "models") -> Checkpoint:
    return Checkpoint(name, Path(name), where, config, (), 0, 0, 0, 0, "bf16", "", 0.0, None)


def real(name: str) -> Checkpoint:
    folder = REAL / name.replace("/", "--")
    config = next(folder.glob("config*.json"))
    return checkpoint(name, json.loads(config.read_text()))


def test_pairing_follows_the_names_and_the_released_configs():
    qat = "google/gemma-4-31B-it-qat-q4_0-unquantized"
    drafters = [real(f"{n}-assistant") for n in ["google/gemma-4-31B-it", qat, "google/gemma-4-E2B-it",
                                                  "google/gemma-4-26B-A4B-it", "google/gemma-4-12B-it"]]
    expected = {
        "google/gemma-4-31B-it": ("google/gemma-4-31B-it-assistant", "name"),
        qat: (f"{qat}-assistant", "name"),
        "google/gemma-4-26B-A4B-it": ("google/gemma-4-26B-A4B-it-assistant", "name"),
        "google/gemma-4-12B-it": ("google/gemma-4-12B-it-assistant", "name"),
        "mlx-community/gemma-4-e2b-it-4bit": ("google/gemma-4-E2B-it-assistant", "family"),
        "mlx-community/gemma-4-e4b-it-4bit": (None, ""),  # no E4B drafter here, and E2B's does not fit
    }
    for target, (drafter, how) in expected.items():
        found, why = choose(real(target), drafters)
        assert (found and found.name, why) == (drafter, how), target
    # a converted copy takes the released drafter, not the QAT one; a name alone pairs nothing
    converted = replace(real("google/gemma-4-31B-it"), name="google/gemma-4-31B-it-4bit")
    assert choose(converted, drafters)[0].name == "google/gemma-4-31B-it-assistant"
    wrong = replace(real("google/gemma-4-E2B-it"), name="google/gemma-4-31B-it")
    assert choose(wrong, drafters) == (None, "")
    assert "backbone_hidden_size 5376" in mismatch(real("google/gemma-4-E2B-it").config, drafters[0].config)


def test_models_json_pairs_and_aliases_override_the_derived_ones(pulled, tmp_path):
    root = copy_of(pulled, tmp_path)
    settings = {"pairs": {E2B: None}, "aliases": {"chat": E2B, "x": "nope/none"}}
    (root / "models.json").write_text(json.dumps(settings))
    store = Store(root, hf_cache=None)
    entry = store.resolve("chat:latest")
    assert (entry.name, entry.drafter, entry.paired_by) == (E2B, None, "models.json")
    assert set(entry.aliases) == {"chat", "gemma4:e2b"}
    problems = [str(p) for p in store.problems()]
    assert problems == ["models.json: alias x names nope/none, which is not in the store"]
    (root / "models.json").write_text("{not json")
    store.refresh()
    assert store.resolve("gemma4:e2b").drafter.name == E2B_DRAFTER
    assert [p.name for p in store.problems()] == ["models.json"]


def test_an_alias_two_models_derive_names_neither(pulled, tmp_path):
    root = copy_of(pulled, tmp_path)
    shutil.copytree(root / E2B, root / "other" / "gemma-4-E2B-it")
    store = Store(root, hf_cache=None)
    several = f"(it could name several models); near: {E2B}, other/gemma-4-E2B-it"
    with pytest.raises(NotFound, match=re.escape(several)):
        store.resolve("gemma4:e2b")
    assert store.resolve("other/gemma-4-E2B-it").drafter.name == E2B_DRAFTER  # paired by family


def test_truncated_and_foreign_files_are_refused_with_their_names_and_never_listed(pulled, tmp_path):
    root = copy_of(pulled, tmp_path)
    for name in ("trunc", "foreign", "sharded"):
        shutil.copytree(root / E2B, root / "bad" / name)
    weights = root / "bad" / "trunc" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    (root / "bad" / "foreign" / "model.safetensors").write_bytes(b"GGUF" + os.urandom(4000))
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (root / "bad" / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "notes.gguf").write_bytes(b"GGUF")
    store = Store(root, hf_cache=None)
    assert [e.name for e in store.entries()] == [E2B]
    problems = sorted(str(p) for p in store.problems())
    assert problems == sorted([
        "bad/trunc: model.safetensors is truncated (982644 bytes, its header says 982744)",
        "bad/foreign: model.safetensors is not a safetensors file",
        "bad/sharded: model.safetensors.index.json names missing shard(s): model-00002-of-00002.safetensors",
        "notes.gguf: a foreign file, not a model directory",
    ])
    with pytest.raises(NotFound, match="refused: model.safetensors is truncated"):
        store.resolve("bad/trunc")


def test_delete_removes_the_pair_and_its_names(pulled, tmp_path):
    root = copy_of(pulled, tmp_path)
    store = Store(root, hf_cache=None)
    assert store.delete("gemma4:e2b").name == E2B
    assert store.entries() == [] and sorted(p.name for p in root.iterdir()) == [".partial", ".trash"]
    assert list((root / ".trash").iterdir()) == []
    with pytest.raises(NotFound):
        store.delete("gemma4:e2b")


def test_the_hugging_face_cache_is_listed_too(hub, tmp_path):
    from huggingface_hub import snapshot_download

    cache = tmp_path / "hf" / "hub"
    for repo in ("testorg/tiny", "testorg/tiny-assistant"):
        snapshot_download(repo, cache_dir=cache, endpoint=hub.url)
    store = Store(tmp_path / "empty", hf_cache=cache)
    entry = store.resolve(TINY_ID)
    assert (entry.where, entry.drafter.where) == ("hf-cache", "hf-cache")
    assert entry.drafter.name == f"{TINY_ID}-assistant"
    store.delete("testorg/tiny")
    assert store.entries() == [] and not list(cache.glob("models--testorg--tiny*/snapshots/*"))


def lister(root: Path, stop: threading.Event, seen: list) -> None:
    """List the store until `stop`, keeping every listing that is neither empty nor the whole pair."""
    store = Store(root, hf_cache=None, rescan_s=0)
    while not stop.is_set():
        names = [(e.name, e.drafter and e.drafter.name) for e in store.entries()]
        if names not in ([], [("testorg/tiny", "testorg/tiny-assistant")]) or store.problems():
            seen.append((names, [str(p) for p in store.problems()]))
        time.sleep(0.01)


def test_a_pull_killed_mid_download_restarts_where_it_stopped_and_nothing_half_is_listed(hub, tmp_path):
    root = tmp_path / "models"
    partial = root / ".partial" / "testorg--tiny-assistant" / "model.safetensors"
    before = {repo: hub.gets(repo, "model.safetensors") for repo in (TINY_ID, f"{TINY_ID}-assistant")}
    hub.slow[TINY_ID] = 100_000  # the target's weights take ~10 s: long enough to kill mid-way
    hub.started.clear()  # (other tests fetched these files too)
    env = {**os.environ, "HF_ENDPOINT": hub.url, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mlx_mtp.store", "pull", TINY_ID, "--models-dir", str(root),
               "--no-hf-cache"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=lister, args=(root, stop, seen))
    watcher.start()
    try:
        assert hub.event(hub.started, TINY_ID, "model.safetensors").wait(60), proc.stderr.read1().decode()
        deadline = time.monotonic() + 20
        while not partial.exists() and time.monotonic() < deadline:  # the drafter finished first
            time.sleep(0.02)
        assert partial.exists() and proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        hub.slow.clear()
        assert Store(root, hf_cache=None).entries() == []
        entry = Store(root, hf_cache=None, endpoint=hub.url).pull("testorg/tiny")
    finally:
        stop.set()
        watcher.join()
        hub.slow.clear()
        proc.kill()
    assert (entry.name, entry.drafter.name) == ("testorg/tiny", "testorg/tiny-assistant")
    assert seen == []
    fetched = {repo: hub.gets(repo, "model.safetensors") - n for repo, n in before.items()}
    assert fetched == {f"{TINY_ID}-assistant": 1, TINY_ID: 2}  # the drafter kept from the killed pull
    assert (entry.target.path / "model.safetensors").read_bytes() == hub.repos[TINY_ID]["model.safetensors"]
    assert not list(root.rglob("*.incomplete"))


def test_the_pulled_model_loads_and_generates(pulled):
    entry = Store(pulled[0], hf_cache=None).resolve("gemma4:e2b")
    loaded = mlx_mtp.load(entry.target.path, drafter=entry.drafter.path)
    result = mlx_mtp.generate(loaded, "Hello", max_tokens=6, draft_tokens=2)  # "auto" may not draft on a CPU
    assert len(result.tokens) == 6 and result.stats.drafted > 0


def test_a_callback_that_raises_stops_the_pull_and_the_next_one_completes(hub, tmp_path):
    store = Store(tmp_path / "models", hf_cache=None, endpoint=hub.url)

    def hang_up(event):  # a client that left mid-stream
        if event.file and event.file.endswith("model.safetensors"):
            raise ConnectionError("client gone")

    with pytest.raises(PullError, match="^stopped by the progress callback: client gone$"):
        store.pull(TINY_ID, progress=hang_up)
    assert store.entries() == [] and store.problems() == []
    assert store.pull(TINY_ID).drafter.name == f"{TINY_ID}-assistant"


def test_the_download_progress_counts_the_bytes_written_of_a_xet_download_too():
    # the Hub serves large files through Xet, whose reporter counts network bytes apart and calls
    # tqdm's display methods; the fake Hub serves plain HTTP, so its reporter is driven here directly
    from huggingface_hub.utils._xet_progress_reporting import XetDownloadProgressReporter

    seen = []
    reporter = XetDownloadProgressReporter(reconstruction_desc="model.safetensors", total=100,
                                           log_level=logging.INFO, tqdm_class=bar_class(seen.append))
    for written, sent in [(0, 30), (40, 60), (100, 90)]:
        reporter.update_progress(SimpleNamespace(
            total_bytes_completed=written, total_transfer_bytes_completed=sent, total_bytes=100,
            total_bytes_completion_rate=None, total_transfer_bytes_completion_rate=None))
    reporter.close()
    assert seen == [40, 100]


def test_a_pull_can_convert_the_target_to_quantized_mlx(hub, tmp_path):
    events = []
    store = Store(tmp_path / "models", hf_cache=None, endpoint=hub.url)
    entry = store.pull(TINY_ID, events.append, quantize="4bit")
    assert (entry.name, entry.target.quantization, entry.drafter.name) == ("testorg/tiny-4bit", "4-bit",
                                                                         "testorg/tiny-assistant")
    converting = [e for e in events if e.status == "converting testorg/tiny to 4bit"]
    assert converting[-1].completed == converting[-1].total == entry.target.bytes
    loaded = mlx_mtp.load(entry.target.path, drafter=entry.drafter.path)
    assert len(mlx_mtp.generate(loaded, "Hi", max_tokens=3).tokens) == 3


def test_a_pull_of_an_unknown_name_says_so_in_one_line(hub, tmp_path):
    store = Store(tmp_path / "models", hf_cache=None, endpoint=hub.url)
    with pytest.raises(PullError, match=r"^nope/none not found on the Hub$"):
        store.pull("nope/none")
    with pytest.raises(PullError, match="unknown tag gemma4:3b"):
        store.pull("gemma4:3b")
    with pytest.raises(PullError, match="MTP drafter"):
        store.pull("testorg/tiny-assistant")
    assert store.entries() == []


def test_the_cli_lists_and_removes(pulled, tmp_path, capsys):
    root = copy_of(pulled, tmp_path)
    nobody = f"http://127.0.0.1:{free_port()}"  # no server there: LOADED is "-", and ps says so
    where = ["--models-dir", str(root), "--no-hf-cache"]
    assert cli(["models", *where, "--host", nobody]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "ALIASES", "SIZE", "QUANTIZATION", "DRAFTER", "LOADED"]
    assert line.split() == [E2B, "gemma4:e2b", "1.2", "MB", "f32", E2B_DRAFTER, "-"]
    assert cli(["rm", "gemma4:e2b", *where]) == 0 and capsys.readouterr().out == f"deleted {E2B}\n"
    assert cli(["rm", "gemma4:e2b", *where]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    assert cli(["ps", "--host", nobody]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no mlx_mtp server answers at {nobody} (" in err and "pass --host" in err


def test_the_progress_bar_without_a_terminal_prints_a_line_per_step_and_file(pulled):
    out = io.StringIO()
    bar = Bar(out)
    for event in pulled[1]:
        bar(event)
    lines = out.getvalue().splitlines()
    assert lines[0] == "pulling manifest" and lines[-1] == "success"
    assert f"{E2B}/model.safetensors (983 KB)" in lines and len(lines) == 4 + 3 + 5  # steps, files


@pytest.mark.parametrize("command", [[], ["models"], ["pull"], ["rm"], ["ps"]])
def test_every_option_of_the_cli_says_its_default(command, capsys):
    with pytest.raises(SystemExit):
        cli([*command, "--help"])
    helps = option_helps(capsys.readouterr().out)
    assert [name for name, text in helps.items() if name != "-h" and "default" not in text] == []


def test_the_chat_and_the_server_take_a_store_name_as_model(pulled, tmp_path):
    """`--model gemma4:e2b` is the pulled pair (its drafter too); an unknown bare name is one line."""
    import subprocess
    import sys

    from mlx_mtp.store import named

    env = {**os.environ, "MLX_MTP_MODELS": str(pulled[0]), "HF_HUB_OFFLINE": "1"}
    entry = Store(pulled[0], hf_cache=None).resolve("gemma4:e2b")
    assert named("gemma4:e2b", store=Store(pulled[0], hf_cache=None)) == (str(entry.target.path),
                                                                         str(entry.drafter.path))
    assert named("someorg/not-here", store=Store(pulled[0], hf_cache=None)) == ("someorg/not-here", None)  # a hub id
    out = subprocess.run([sys.executable, "-m", "mlx_mtp.chat", "--model", "gemma4:e2b", "--raw", "--prompt", "hi",
                          "--max-tokens", "3", "--draft-tokens", "2"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and "MTP rounds" in out.stderr, out.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "mlx_mtp.chat", "--model", "gemma4:nope", "--prompt", "hi"],
                         capture_output=True, text=True, env=env, timeout=120)
    lines = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode != 0 and len(lines) == 1 and "mlx-mtp pull gemma4:nope" in lines[0], bad.stderr[-2000:]
