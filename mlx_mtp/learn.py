"""`python -m mlx_mtp.learn DIR --out NEW`: a drafter adapted to the traffic it serves.

Acceptance, the multiple every MTP speedup is of, depends on how well the drafter predicts *this*
user's target outputs. `DIR` holds served requests (`mlx_mtp.capture`: the server's `--learn-dir`);
the drafter is distilled on them (`mlx_mtp.distill`) and judged on the newest tenth, which training
never sees, and on a general sample (by default the Python standard library's source, text any
machine has): NEW is written only if the drafts it makes on held-out traffic are accepted more, and
those on the general sample at most 2% less (else one line says so). The drafter it starts from is
never written to. Training goes in checkpoints (`NEW.partial`), so a run that is stopped resumes where
it was. An adapted drafter changes no output: the target decides every token, greedy or sampled.

`Learner` is the same, in an `Engine` (`learn_every`): after that many new requests it adapts, a step
at a time while the engine is idle, and puts the drafter it wrote in service.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import logging
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import capture, distill
from .cli import demo_pair, error_line, prog_name
from .loading import load_model, load_tokenizer, read_config, resolve

log = logging.getLogger("mlx_mtp")

HELD_OUT = 0.1  # the newest share of the captured requests: the test
GENERAL_DROP = 0.02  # the most the general sample's acceptance may fall
K = 3  # drafts per round the acceptance is measured at
MIN_REQUESTS = 20
GENERAL_FILES = ("os.py", "argparse.py", "json/encoder.py", "textwrap.py", "pathlib.py", "shutil.py",
                 "string.py", "csv.py")  # the general sample's default: judged on, never trained on
REPLAY_FILES = ("collections/__init__.py", "functools.py", "inspect.py", "typing.py", "subprocess.py", "tarfile.py",
                "email/message.py", "logging/__init__.py", "datetime.py", "random.py", "statistics.py", "enum.py",
                "dataclasses.py", "zipfile/__init__.py", "zipfile.py", "difflib.py", "pprint.py", "configparser.py")


def split(records: Sequence[capture.Record]) -> tuple[list, list]:
    """(train, held out): the newest HELD_OUT of the requests are the test."""
    ordered = sorted(records, key=lambda r: r.time)
    cut = len(ordered) - max(1, int(round(HELD_OUT * len(ordered))))
    return ordered[:cut], ordered[cut:]


def stdlib(names: Sequence[str]) -> list[Path]:
    """Those modules of this Python's standard library source that exist here."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / name for name in names if (root / name).exists()]


def general_sample(tokenizer, paths: Optional[Sequence[Path]] = None, chunks: int = 12,
                   seq: int = 256) -> list[tuple]:
    """(ids, first) chunks of text the drafter is not adapted to: `paths` (text files or .npy ids), or
    modules of the standard library's source."""
    ids = distill.load_tokens(paths or stdlib(GENERAL_FILES), tokenizer)
    step = max(seq, len(ids) // chunks)
    return [(ids[i : i + seq], seq // 4) for i in range(0, len(ids) - seq, step)][:chunks]


class Adaptation:
    """One adaptation: a float copy of the drafter distilled on the captured requests, measured before
    and after on the held-out ones and the general sample (accepted drafts per greedy round of K).
    `work()` does it a piece at a time (a sequence measured, a training step), so an engine can
    interleave it with requests."""

    def __init__(self, target, drafter_dir, records: Sequence[capture.Record], general: list, *, steps: int = 300,
                 seq: int = 256, batch: int = 8, lr: float = 1e-3, seed: int = 0, replay: Optional[np.ndarray] = None,
                 measure: int = 1024):
        if len(records) < MIN_REQUESTS:
            raise ValueError(f"{len(records)} captured requests; adapting needs at least {MIN_REQUESTS}")
        drafter, self.config, _ = load_model(drafter_dir)
        if "quantization" in self.config:
            raise ValueError(f"{drafter_dir} is quantized; adapt an unquantized (bf16/fp32) drafter")
        self.dtype = drafter.model.embed_tokens.weight.dtype  # what the adapted one is saved in
        drafter.set_dtype(mx.float32)  # trained in fp32
        self.target, self.drafter, self.general = target, drafter, general
        train, held = split(records)
        self.held = [window(r, measure) for r in held]
        stream = np.concatenate([r.tokens for r in train])
        if replay is not None and len(replay):  # as much of what it was good at: it keeps it (no forgetting)
            stream = np.concatenate([stream, replay[: len(stream)]])
        self.distiller = distill.Distiller(target, drafter, stream, steps=steps, k=K, seq=min(seq, len(stream) - 1),
                                           batch=batch, lr=lr, seed=seed)
        self.requests, self.tokens = len(train), int(len(stream))
        self.before: Optional[dict] = None
        self.report: Optional[dict] = None  # the verdict's, once done

    @property
    def trained(self) -> bool:
        return self.distiller.done >= self.distiller.steps

    def work(self, minutes: Optional[float] = None) -> Iterator[Optional[float]]:
        """Measure, train, measure again: yields after each piece (a training step yields its loss),
        then sets `report` (`better`: held-out acceptance up, general down at most GENERAL_DROP)."""
        started = time.perf_counter()
        if self.before is None:  # a resumed adaptation keeps the measure of the drafter it started from
            self.before = yield from self._measure()
        while not self.trained and (minutes is None or time.perf_counter() - started < 60 * minutes):
            self.drafter.train()
            yield self.distiller.step()[0]
        after = yield from self._measure()
        self.report = dict(before=self.before, after=after, k=K, steps=self.distiller.done,
                           better=better(self.before, after),
                           train_requests=self.requests, train_tokens=self.tokens, held_out_requests=len(self.held))

    def _measure(self) -> Iterator[None]:
        self.drafter.eval()
        out = {}
        for name, sequences in (("held_out", self.held), ("general", self.general)):
            runs = []
            for ids, first in sequences:
                runs.append(distill.accepted_runs(self.target, self.drafter, ids, first, K))
                yield None
            joined = np.concatenate(runs) if runs else np.zeros(0)
            out[name] = float(joined.mean()) if len(joined) else 0.0
        return out


def better(before: dict, after: dict) -> bool:
    """The verdict: held-out acceptance up, the general sample's down by at most GENERAL_DROP."""
    return after["held_out"] > before["held_out"] and after["general"] >= before["general"] * (1 - GENERAL_DROP)


def window(r: capture.Record, size: int) -> tuple[np.ndarray, int]:
    """(ids, first): at most `size` tokens of a request to measure on, the reply's first three quarters
    of them after (at most) a quarter of the prompt's end as context; one target pass holds them."""
    context = min(len(r.prompt), size // 4)
    return r.tokens[len(r.prompt) - context : len(r.prompt) + size - context], context


def say(report: dict) -> str:
    b, a = report["before"], report["after"]
    return (f"accepted drafts per round (K={report['k']}): held-out {b['held_out']:.3f} -> {a['held_out']:.3f} "
            f"({_change(b['held_out'], a['held_out'])}), general {b['general']:.3f} -> {a['general']:.3f} "
            f"({_change(b['general'], a['general'])})")


def _change(before: float, after: float) -> str:
    return f"{100 * (after - before) / before:+.1f}%" if before else "from 0"


def adapt(target, drafter_dir, records, general, out: Path, *, steps: int = 300, seq: int = 256, batch: int = 8,
          lr: float = 1e-3, seed: int = 0, minutes: Optional[float] = None, checkpoint_every: int = 25,
          replay: Optional[np.ndarray] = None, progress: Callable[[str], None] = print) -> dict:
    """Adapt, resuming from `out`.partial if a run with these inputs stopped there; write `out` only
    if the adapted drafter is better. Returns the report (with `written`)."""
    out = Path(out)
    check_out(out, drafter_dir)
    a = Adaptation(target, drafter_dir, records, general, steps=steps, seq=seq, batch=batch, lr=lr, seed=seed,
                   replay=replay)
    partial = out.with_name(out.name + ".partial")
    key = _key(drafter_dir, records, steps, seq, batch, lr, seed)
    info = json.loads((partial / "state.json").read_text()) if (partial / "state.json").exists() else {}
    if info.get("key") == key:
        a.distiller.restore(mx.load(str(partial / "state.safetensors")), info)
        a.before = info["before"]
        progress(f"resuming at step {a.distiller.done} of {steps} ({partial})")
    started, bar = time.perf_counter(), Progress(steps, progress)
    for loss in a.work(minutes):
        if loss is not None:
            bar.show(a.distiller.done, loss)
            if a.distiller.done % checkpoint_every == 0 and not a.trained:
                _checkpoint(a.distiller, partial, {"key": key, "before": a.before})
    report = dict(a.report, seconds=round(time.perf_counter() - started, 1), written=a.report["better"], out=str(out))
    if report["written"]:
        distill.save_drafter(a.drafter, a.config, out, extra=report, dtype=a.dtype)
        progress(f"wrote {out}: {say(report)}")
    else:
        progress(f"not written: the adapted drafter is not better ({say(report)}; held-out must rise, general "
                 f"fall at most {100 * GENERAL_DROP:.0f}%)")
    shutil.rmtree(partial, ignore_errors=True)
    return report


def check_out(out, drafter_dir) -> None:
    """The adapted drafter never overwrites the one it is adapted from."""
    if Path(out).resolve() == Path(drafter_dir).resolve():
        raise ValueError("--out is the drafter adapted from: write the adapted one elsewhere")


def _key(drafter_dir, records, *args) -> str:
    """What a checkpoint belongs to: the drafter, the requests (count and newest), the training's settings."""
    newest = max((r.time for r in records), default=0.0)
    return hashlib.sha256(json.dumps([str(Path(drafter_dir).resolve()), len(records), newest, *args]).encode()
                          ).hexdigest()[:16]


def _checkpoint(distiller: distill.Distiller, folder: Path, extra: dict) -> None:
    """The distillation's state, written beside and renamed into place (a stop mid-write keeps the last)."""
    arrays, info = distiller.state()
    temp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    mx.save_safetensors(str(temp / "state.safetensors"), arrays)
    (temp / "state.json").write_text(json.dumps({**info, **extra}))
    shutil.rmtree(folder, ignore_errors=True)
    temp.rename(folder)


class Progress:
    """A progress line: redrawn in place on a terminal, every tenth of the way otherwise."""

    def __init__(self, total: int, out: Callable[[str], None]):
        self.total, self.out, self.said = total, out, -1
        self.first: Optional[tuple] = None  # (step, time) of the first step shown: the rate counts from it

    def show(self, done: int, loss: float) -> None:
        now = time.perf_counter()
        self.first = self.first or (done, now)
        elapsed = now - self.first[1]
        left = elapsed / max(done - self.first[0], 1) * (self.total - done) if done > self.first[0] else 0.0
        line = (f"[{'#' * (20 * done // self.total):<20}] step {done}/{self.total}, loss {loss:.3f}, "
                f"~{left:.0f} s left")
        if sys.stderr.isatty():
            print("\r" + line, end="" if done < self.total else "\n", file=sys.stderr, flush=True)
        elif 10 * done // self.total > self.said:
            self.said = 10 * done // self.total
            self.out(line)


class Learner:
    """An Engine's served requests kept (`capture.Capture` in `folder`, within `budget` bytes) and, every
    `every` new ones (with `drafter_dir`, the unquantized drafter in service), an adaptation run a piece
    at a time in the engine's idle time (`step`: a sequence measured or a training step, about a prompt
    chunk's work); a better drafter is saved under `folder`/drafters and put in service (`swap`)."""

    def __init__(self, folder, budget: Optional[int], every: Optional[int], drafter_dir, loaded, swap: Callable,
                 chunk: int = 512, steps: int = 200):
        self.folder, self.every, self.drafter_dir = Path(folder), every, drafter_dir
        self.loaded, self.swap = loaded, swap
        if every is not None and drafter_dir is None:
            raise ValueError("adapting in the background (learn_every) needs the drafter's directory (drafter_dir)")
        if every is not None and "quantization" in read_config(resolve(drafter_dir)):
            raise ValueError(f"{drafter_dir} is quantized; adapting in the background needs the unquantized drafter")
        self.capture = capture.Capture(folder, budget)
        self.steps, self.new, self.adaptation, self.pieces, self.inputs = steps, 0, None, None, None
        self.seq = min(256, chunk)
        self.batch = max(1, chunk // self.seq)  # a training step: a prompt chunk's tokens through the target
        self.reports: list = []

    def finished(self, prompt: Sequence[int], reply: Sequence[int], stats) -> None:
        """A served request ended: keep its ids and the drafter's counts on it."""
        counts = (stats.rounds, stats.drafted, stats.accepted) if stats is not None else (0, 0, 0)
        self.capture.add(prompt, reply, *counts)
        self.new += 1

    def wants_time(self) -> bool:
        return self.pieces is not None or self.inputs is not None or (self.every is not None and self.new >= self.every)

    def step(self) -> None:
        """One piece of the background adaptation. Starting one reads the requests and tokenizes the
        samples on a thread of its own (no MLX there), so no piece takes longer than a chunk."""
        try:
            if self.pieces is None and self.inputs is None:
                self.new = 0
                pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlx_mtp-learn")
                self.inputs = pool.submit(self._read)
                pool.shutdown(wait=False)
            elif self.pieces is None:
                try:
                    records, general, replay = self.inputs.result(timeout=0.05)
                except concurrent.futures.TimeoutError:
                    return
                self.inputs = None
                self.adaptation = Adaptation(self.loaded.target, self.drafter_dir, records, general, steps=self.steps,
                                             seq=self.seq, batch=self.batch, measure=self.seq * self.batch,
                                             replay=replay)
                self.pieces = self.adaptation.work()
            else:
                next(self.pieces)
        except StopIteration:
            self._done()
        except (OSError, ValueError) as e:  # too few requests, a bad drafter dir: try again after `every` more
            log.warning("background adaptation: %s", e)
            self.pieces = self.adaptation = self.inputs = None

    def _read(self) -> tuple:
        tokenizer = self.loaded.tokenizer
        return (capture.newest(self.folder, 20_000_000), general_sample(tokenizer),
                distill.load_tokens(stdlib(REPLAY_FILES), tokenizer))

    def _done(self) -> None:
        a, self.pieces, self.adaptation = self.adaptation, None, None
        self.reports.append(a.report)
        if not a.report["better"]:
            log.info("background adaptation: not better, the drafter in service stays (%s)", say(a.report))
            return
        out = self.folder / "drafters" / time.strftime("%Y%m%d-%H%M%S")
        distill.save_drafter(a.drafter, a.config, out, extra=a.report, dtype=a.dtype)
        self.drafter_dir = out  # the next adaptation goes on from this one
        self.swap(out)
        log.info("background adaptation: %s in service (%s)", out, say(a.report))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog_name("mlx_mtp.learn"), description=__doc__.splitlines()[0])
    ap.add_argument("captures", metavar="DIR", help="captured requests (the server's --learn-dir)")
    ap.add_argument("--target", help="the target model dir or hub id (frozen; default: the bundled demo pair's)")
    ap.add_argument("--drafter", help="the MTP drafter to adapt (unquantized; never written to; default: the "
                                      "demo pair's, without --target)")
    ap.add_argument("--out", required=True, help="where the adapted drafter goes, if it is better")
    ap.add_argument("--general", nargs="+", help="text files or .npy ids it must stay good at (default: modules "
                                                  "of the Python standard library)")
    ap.add_argument("--replay", nargs="+", help="text files or .npy ids of what it was trained on, mixed into training "
                                                 "so that it keeps it (default: other modules of the standard library)")
    ap.add_argument("--no-replay", action="store_true", help="train on the captured requests alone")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq", type=int, default=256, help="tokens per training chunk")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, help="stop training after this long (then judge what it has)")
    ap.add_argument("--max-tokens", type=int, default=20_000_000,
                    help="the newest captured tokens read (bounds memory: 4 bytes each; default 20M)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.target is None:
            args.target, demo_drafter = demo_pair()
            args.drafter = args.drafter or demo_drafter
        if args.drafter is None:
            raise ValueError("--drafter: the MTP drafter of --target to adapt")
        if not Path(args.captures).is_dir():
            raise FileNotFoundError(f"{args.captures}: no such directory of captured requests")
        records = capture.newest(args.captures, args.max_tokens)
        if len(records) < MIN_REQUESTS:
            raise ValueError(f"{args.captures} holds {len(records)} captured requests; adapting needs at least "
                             f"{MIN_REQUESTS}")
        check_out(args.out, args.drafter)  # before loading anything
        target, _, path = load_model(args.target, dtype=mx.float32)
        tokenizer = load_tokenizer(path)
        general = general_sample(tokenizer, args.general, seq=args.seq)
        replay = None if args.no_replay else distill.load_tokens(args.replay or stdlib(REPLAY_FILES), tokenizer)
        print(f"{len(records)} captured requests; adapting {args.drafter} for {args.steps} steps", flush=True)
        adapt(target, args.drafter, records, general, Path(args.out), steps=args.steps, seq=args.seq,
              batch=args.batch, lr=args.lr, seed=args.seed, minutes=args.minutes, replay=replay,
              progress=lambda s: print(s, flush=True))
    except (OSError, ValueError) as e:
        print(error_line(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
