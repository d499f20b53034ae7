"""Pulls from the Hugging Face Hub: a target together with its drafter, into the models dir.

Each repo is fetched with huggingface_hub (`hf_hub_download`, a few files at a time, with its own
retries and progress) into `<models>/.partial/<org>--<name>/`, checked (sha256 against the Hub's,
then every safetensors header against its file), and only then renamed into `<models>/<org>/<name>/`,
the drafter first: a drafter alone is never listed as a model, so no listing ever shows half a
model. A pull killed at any point, kill -9 included, leaves only `.partial/`: the next pull keeps
the files finished there (huggingface_hub records each one) and fetches the rest. A lock file per
repo keeps two pulls, in two processes or two threads, from writing one `.partial/` at once; the
system drops it with the process that held it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable, Optional

from ..loading import check_quantization
from ..models import DRAFTER_TYPES, model_module
from ..models.base import ConfigError
from .checkpoint import inspect
from .errors import NotOnHub, PullError, Refused
from .names import CATALOG, DEFAULT_TAG, FAMILY, LATEST, Name
from .pairing import mismatch
from .places import discard
from .settings import Settings

# --quantize values: convert's options for each (the drafter is kept as released)
QUANTIZE = {"4bit": {"bits": 4}, "8bit": {"bits": 8}, "mixed_4_8": {"preset": "mixed_4_8"},
            "mxfp4": {"mode": "mxfp4"}, "nvfp4": {"mode": "nvfp4"}, "mxfp8": {"mode": "mxfp8"}}
PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt")  # what loading reads
RECORD = ".pull.json"  # in an installed repo: where and at which revision it came from
WORKERS = 4  # files fetched at once
THIN = 0.2  # seconds between two progress events of one file


@dataclass(frozen=True)
class PullEvent:
    """One step of a pull. `status` is Ollama's: "pulling manifest", "downloading <digest>" (with
    `total` and `completed` bytes of that file), "verifying sha256 digest", "converting <repo> to
    <quantization>" (bytes written of those expected), "writing manifest", "success"."""

    status: str
    digest: Optional[str] = None  # "sha256:<hex>" (a weight file), "blob:<git id>" (a small file)
    total: Optional[int] = None
    completed: Optional[int] = None
    file: Optional[str] = None  # "<repo>/<path>"

    def json(self) -> dict:
        """The line Ollama's `/api/pull` streams for this event."""
        fields = ("status", "digest", "total", "completed")
        return {k: getattr(self, k) for k in fields if getattr(self, k) is not None}


@dataclass(frozen=True)
class Plan:
    """What a pull name means on the Hub."""

    target: str  # Hub repo
    drafter: Optional[str]  # Hub repo pulled with it, None for none
    drafter_named: bool  # models.json names it: a missing drafter fails the pull
    quantize: Optional[str]  # convert the target on pull (a QUANTIZE key)

    @classmethod
    def of(cls, text: str, quantize: Optional[str], settings: Settings) -> "Plan":
        """`gemma4:<tag>` (Ollama's tags; `-<quantization>` appended converts, e.g. `gemma4:31b-4bit`)
        or a Hub id (`google/gemma-4-31B-it`, `hf.co/...`); the drafter: models.json's, else the
        repo's name plus `-assistant`."""
        name = Name.parse(text)
        spec = None
        if name.path.casefold() == FAMILY:
            size, _, spec = (LATEST if name.tag == DEFAULT_TAG else name.tag.lower()).partition("-")
            if size not in CATALOG or (spec and spec not in QUANTIZE):
                raise PullError(f"unknown tag {name}: {FAMILY} has {', '.join(CATALOG)} and latest, each "
                                f"with an optional -<quantization> ({', '.join(QUANTIZE)})")
            repo = CATALOG[size]
        elif "/" in name.path and name.tag == DEFAULT_TAG:
            repo = name.path
        else:
            raise PullError(f"cannot pull {text!r}: name a Hub repo (org/name) or a {FAMILY} tag "
                            f"({', '.join(f'{FAMILY}:{t}' for t in CATALOG)})")
        if quantize and spec and quantize != spec:
            raise PullError(f"{text} asks for {spec}, the quantize option for {quantize}")
        spec = spec or quantize or None
        if spec is not None and spec not in QUANTIZE:
            raise PullError(f"unknown quantization {spec!r} (known: {', '.join(QUANTIZE)})")
        stored = f"{repo}-{spec}" if spec else repo
        named, drafter = settings.pair(stored)
        if not named:
            named, drafter = settings.pair(repo)
        return cls(repo, drafter if named else f"{repo}-assistant", named and drafter is not None, spec)


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: Optional[str]  # the Hub's for a large (LFS) file; small files are git blobs
    blob: str

    @property
    def digest(self) -> str:
        return f"sha256:{self.sha256}" if self.sha256 else f"blob:{self.blob}"


@dataclass(frozen=True)
class Remote:
    """A repo's manifest at one revision: the files a load needs."""

    repo: str
    revision: str
    files: tuple[RemoteFile, ...]


@dataclass
class Job:
    """One repo to bring into the models dir."""

    remote: Remote
    dest: Path  # where it is installed
    partial: Path  # where it is fetched
    quantize: Optional[str] = None
    built: Optional[Path] = None  # the conversion's output, installed in place of `partial`
    current: bool = False  # installed already, at this revision

    def config(self) -> dict:
        return json.loads(((self.dest if self.current else self.partial) / "config.json").read_text())


class Events:
    """The caller's progress callback, called one event at a time (files download on several
    threads), each file's events at most every THIN seconds between its first and its last."""

    def __init__(self, callback: Optional[Callable[[PullEvent], None]]):
        self.callback = callback
        self._emit, self._thin = threading.Lock(), threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # file -> (time, bytes) of its last event

    def __call__(self, status: str, **fields) -> None:
        """Raises PullError from whatever the callback raises: that is how a caller stops a pull."""
        if self.callback is None:
            return
        with self._emit:
            try:
                self.callback(PullEvent(status, **fields))
            except Exception as e:
                raise PullError(f"stopped by the progress callback: {_line(e)}") from e

    def file(self, repo: str, f: RemoteFile, completed: int) -> None:
        where, now = f"{repo}/{f.path}", time.monotonic()
        completed = min(completed, f.size)
        with self._thin:
            last = self._last.get(where)
            if last is not None and (completed == last[1] or completed < f.size and now - last[0] < THIN):
                return
            self._last[where] = (now, completed)
        self(f"downloading {f.digest}", digest=f.digest, total=f.size, completed=completed, file=where)


class _Bar:
    """What huggingface_hub drives in place of a tqdm bar (its `tqdm_class`): the bytes written to
    the file go to `report`; network bytes (`update_transfer`, which Xet downloads count apart) and
    tqdm's display calls are dropped."""

    report: Callable[[int], None]

    def __init__(self, *_, total: Optional[int] = None, initial: int = 0, **__):
        self.n, self.total = initial, total

    def update(self, n: int = 1) -> None:
        self.n += n
        self.report(self.n)

    def update_transfer(self, n: int = 1) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name: str):  # set_postfix_str, refresh, close...: display only
        return lambda *args, **kwargs: None


def bar_class(report: Callable[[int], None]) -> type:
    """A `tqdm_class` for one file. A class, not a partial: huggingface_hub looks for methods on it."""
    return type("FileBar", (_Bar,), {"report": staticmethod(report)})


class Puller:
    """Pulls into one models dir, through one Hub endpoint (None: huggingface_hub's default)."""

    def __init__(self, root: Path, endpoint: Optional[str], settings: Settings):
        self.root, self.endpoint, self.settings = root, endpoint, settings

    def pull(self, text: str, progress: Optional[Callable[[PullEvent], None]] = None,
             quantize: Optional[str] = None) -> str:
        """Pull `text` (see `Plan.of`); returns the store name it is installed under."""
        events, plan = Events(progress), Plan.of(text, quantize, self.settings)
        events("pulling manifest")
        target = self._manifest(plan.target, required=True)
        drafter = self._manifest(plan.drafter, required=plan.drafter_named) if plan.drafter else None
        stored = f"{target.repo}-{plan.quantize}" if plan.quantize else target.repo
        jobs = ([Job(drafter, self.root / drafter.repo, self._partial(drafter.repo))] if drafter else []) + \
            [Job(target, self.root / stored, self._partial(target.repo), plan.quantize)]
        with contextlib.ExitStack() as held:
            for repo in sorted({stored} | {j.remote.repo for j in jobs}):  # one order: no two pulls deadlock
                held.enter_context(self._lock(repo, events))
            self._bring(jobs, events)
        events("success")
        return stored

    def _bring(self, jobs: list[Job], events: Events) -> None:
        """Fetch, check, convert and install what is not installed at its revision already."""
        for job in jobs:
            job.current = _installed(job)
            for f in job.remote.files:  # every file up front: a bar knows the whole size from the start
                events.file(job.remote.repo, f, f.size if job.current else 0)
        self._check_configs(jobs, events)
        todo = [j for j in jobs if not j.current]
        self._download(todo, events)
        events("verifying sha256 digest")
        for job in todo:
            self._verify(job)
        for job in todo:
            if job.quantize:
                self._convert(job, events)
        events("writing manifest")
        for job in todo:  # the drafter first: a target never lists without it
            self._install(job)

    def _partial(self, repo: str) -> Path:
        return self.root / ".partial" / repo.replace("/", "--")

    @contextlib.contextmanager
    def _lock(self, repo: str, events: Events):
        path = self._partial(repo)
        path = path.with_name(path.name + ".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:  # closing it, or the process ending, releases the lock
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                events(f"waiting for another pull of {repo}")
                fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _manifest(self, repo: str, required: bool) -> Optional[Remote]:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

        try:
            info = HfApi(endpoint=self.endpoint).model_info(repo, files_metadata=True)
        except GatedRepoError as e:
            raise PullError(f"{repo} is gated: accept its terms on its Hub page, then `hf auth login`") from e
        except RepositoryNotFoundError as e:
            if not required:
                return None
            raise NotOnHub(f"{repo} not found on the Hub") from e
        except Exception as e:  # offline, refused, a bad answer: one line
            raise PullError(f"cannot read {repo} from the Hub: {_line(e)}") from e
        files = tuple(RemoteFile(s.rfilename, s.size or 0, s.lfs.sha256 if s.lfs else None, s.blob_id or "")
                      for s in info.siblings or [] if "/" not in s.rfilename
                      and any(fnmatch(s.rfilename, p) for p in PATTERNS))
        names = {f.path for f in files}
        if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
            raise PullError(f"{repo} has no config.json and .safetensors weights to pull")
        same = info.id and info.id.casefold() == repo.casefold()  # the Hub's spelling, never another path
        return Remote(info.id if same else repo, info.sha, files)

    def _check_configs(self, jobs: list[Job], events: Events) -> None:
        """Fetch each config first: a repo we cannot serve fails before its weights are fetched."""
        for job in jobs:
            if not job.current:
                _clean(job.partial)
                self._fetch(job, next(f for f in job.remote.files if f.path == "config.json"), events)
        *drafter, target = jobs
        config = target.config()
        if config.get("model_type") in DRAFTER_TYPES:
            raise PullError(f"{target.remote.repo} is an MTP drafter; pull the model it drafts for")
        problem = _unsupported(target)
        if problem is None and drafter:
            problem = mismatch(config, drafter[0].config())
            problem = problem and f"{drafter[0].remote.repo} cannot draft for {target.remote.repo}: {problem}"
        if problem:
            raise PullError(problem)

    def _download(self, jobs: list[Job], events: Events) -> None:
        work = [(job, f) for job in jobs for f in job.remote.files if f.path != "config.json"]
        pool = ThreadPoolExecutor(WORKERS)
        try:
            for done in [pool.submit(self._fetch, job, f, events) for job, f in work]:
                done.result()
        finally:  # on an error, files not started are not started (those running finish)
            pool.shutdown(wait=False, cancel_futures=True)

    def _fetch(self, job: Job, f: RemoteFile, events: Events) -> None:
        from huggingface_hub import hf_hub_download

        report = functools.partial(events.file, job.remote.repo, f)
        report(0)
        try:
            hf_hub_download(job.remote.repo, f.path, revision=job.remote.revision, local_dir=job.partial,
                            endpoint=self.endpoint, tqdm_class=bar_class(report))
        except PullError:
            raise
        except Exception as e:
            raise PullError(f"{job.remote.repo}/{f.path}: {_line(e)}") from e
        report(f.size)

    def _verify(self, job: Job) -> None:
        large = [f for f in job.remote.files if f.sha256]
        with ThreadPoolExecutor(WORKERS) as pool:  # hashlib hashes large blocks off the GIL
            digests = list(pool.map(_sha256, [job.partial / f.path for f in large]))
        for f, digest in zip(large, digests):
            if digest != f.sha256:
                (job.partial / f.path).unlink()  # the next pull fetches it anew
                raise PullError(f"{job.remote.repo}/{f.path}: sha256 differs from the Hub's; pull again")
        try:
            inspect(job.remote.repo, job.partial, "models")
        except Refused as e:
            raise PullError(str(e)) from e

    def _convert(self, job: Job, events: Events) -> None:
        """Quantize the fetched target to MLX with the project's converter, reporting the bytes it
        has written of those it will write."""
        from convert.convert import convert, plan

        options = {"quantize": True, **QUANTIZE[job.quantize]}
        _, _, planned = plan(job.partial, shapes_only=True, progress=False, **options)  # config.json only
        total = sum(v.nbytes for v in planned.values())
        del planned
        out = self._partial(job.dest.relative_to(self.root).as_posix())
        status = f"converting {job.remote.repo} to {job.quantize}"
        stop = threading.Event()

        def watch():
            while not stop.wait(0.25):
                try:
                    events(status, total=total, completed=min(_written(out), total))
                except (OSError, PullError):  # renamed away; or stopped: that shows when the conversion ends
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            convert(job.partial, out, force=True, progress=False, **options)
        except Exception as e:
            raise PullError(f"converting {job.remote.repo}: {_line(e)}") from e
        finally:
            stop.set()
            watcher.join()
        events(status, total=total, completed=total)
        job.built = out

    def _install(self, job: Job) -> None:
        src = job.built or job.partial
        shutil.rmtree(src / ".cache", ignore_errors=True)
        if not job.built:
            wanted = {f.path for f in job.remote.files}
            for extra in [p for p in src.iterdir() if p.is_file() and p.name not in wanted]:
                extra.unlink()  # left by an older revision of the repo
        record = {"repo": job.remote.repo, "revision": job.remote.revision, "quantize": job.quantize}
        (src / RECORD).write_text(json.dumps(record, indent=1))
        job.dest.parent.mkdir(parents=True, exist_ok=True)
        if job.dest.exists():
            discard(self.root, job.dest)
        os.replace(src, job.dest)
        if job.built:
            shutil.rmtree(job.partial, ignore_errors=True)  # the unconverted download


def _installed(job: Job) -> bool:
    """Whether the repo is installed at this revision (and quantization), its files whole."""
    try:
        record = json.loads((job.dest / RECORD).read_text())
        inspect(job.remote.repo, job.dest, "models")
    except (OSError, ValueError, Refused):
        return False
    return record.get("revision") == job.remote.revision and record.get("quantize") == job.quantize


def _unsupported(job: Job) -> Optional[str]:
    config = job.config()
    try:
        model_module(config["model_type"]).Config.from_dict(config)
        check_quantization(config, Path(job.remote.repo))  # (the path names the repo in its message)
    except (ConfigError, KeyError) as e:
        return f"{job.remote.repo}: {_line(e)}"
    return None


def _written(out: Path) -> int:
    """Bytes the converter has written so far: it writes into `.<out>.partial-<pid>/`."""
    return sum(p.stat().st_size for d in out.parent.glob(f".{out.name}.partial-*") for p in d.iterdir()
               if p.is_file())


def _clean(partial: Path) -> None:
    """Drop the unfinished files of a killed pull: from huggingface_hub 1.18 on, each attempt
    writes a file of its own, which no later attempt resumes."""
    for stale in (partial / ".cache").rglob("*.incomplete") if (partial / ".cache").is_dir() else ():
        stale.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 23):
            digest.update(block)
    return digest.hexdigest()


def _line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
