"""`python -m mlx_mtp.learn DIR --out NEW`: a drafter adapted to the traffic it serves.

Acceptance, the multiple every MTP speedup is of, depends on how well the drafter predicts *this*
user's target outputs. `DIR` holds served requests (`mlx_mtp.learn.capture`: the server's `--learn-dir`);
the drafter is distilled on them (`mlx_mtp.learn.distill`) and judged on the newest tenth, which training
never sees, and on a general sample (by default the Python standard library's source, text any
machine has): NEW is written only if the drafts it makes on held-out traffic are accepted more, by more
than the measurement's noise (two standard errors, paired request by request), and those on the general
sample at most 2% less beyond theirs (else one line says so). `--minutes` bounds the whole run: the
held-out sample measured is what fits in a quarter of it, training gets the rest; the target's features
are computed once per window and kept. The drafter it starts from is never written to. Training goes in
checkpoints (`NEW.partial`), so a run that is stopped resumes where it was. An adapted drafter changes no
output: the target decides every token, greedy or sampled.

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
from ..cli import demo_pair, error_line, prog_name
from ..loading import load_model, load_tokenizer, read_config, resolve
from ..models.base import SharedKV, cpu_stream_count
from ..runtime.threads import mark_mlx_thread

log = logging.getLogger("mlx_mtp")

HELD_OUT = 0.1  # the newest share of the captured requests: the test
GENERAL_DROP = 0.02  # the most the general sample's acceptance may fall
K = 3  # drafts per round the acceptance is measured at
MEASURE_SHARE = 0.25  # of a run bounded in time, the most that measuring the held-out requests before takes
BATCH_MEASURE = 8  # sequences measured per target forward
REPLAY_SHARE = 1 / 3  # replay windows per captured one
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


def general_sample(tokenizer, paths: Optional[Sequence[Path]] = None, chunks: int = BATCH_MEASURE,
                   seq: int = 128) -> list[tuple]:
    """(ids, first) chunks of text the drafter is not adapted to: `paths` (text files or .npy ids), or
    modules of the standard library's source."""
    ids = distill.load_tokens(paths or stdlib(GENERAL_FILES), tokenizer)
    step = max(seq, len(ids) // chunks)
    return [(ids[i : i + seq], seq // 4) for i in range(0, len(ids) - seq, step)][:chunks]


class Measure:
    """Accepted drafts per round of K on fixed (ids, first) sequences, measured in batches of `batch`
    rows; the target's features of each batch are kept, so a second measure (after training) runs only
    the drafter. `run` gives, per sequence, (accepted drafts summed, positions): `mean`, `paired_margin`."""

    def __init__(self, target, sequences: Sequence[tuple], batch: int = BATCH_MEASURE):
        usable = [(np.asarray(ids, np.int32), first) for ids, first in sequences if len(ids) - K > max(first, 1)]
        self.target, self.batches = target, [usable[i : i + batch] for i in range(0, len(usable), batch)]
        self.features: list = []
        self.seconds = {"target": 0.0, "drafter": 0.0}

    def __len__(self) -> int:
        return sum(map(len, self.batches))

    def keep(self, sequences: int) -> None:
        """Only the first `sequences` (whole batches) from now on: the sample a bounded run measured."""
        kept, total = [], 0
        for rows in self.batches:
            if total >= sequences:
                break
            kept.append(rows)
            total += len(rows)
        self.batches = kept

    def run(self, drafter, i: int) -> list[tuple[float, int]]:
        """Batch i's per-sequence (accepted, positions) under `drafter`."""
        rows = self.batches[i]
        started = time.perf_counter()
        if i == len(self.features):
            self.features.append(distill.rows_pass(self.target, [ids for ids, _ in rows]))
        middle = time.perf_counter()
        runs = distill.runs_on(drafter, self.features[i], [f for _, f in rows], [len(ids) for ids, _ in rows], K)
        self.seconds["target"] += middle - started
        self.seconds["drafter"] += time.perf_counter() - middle
        return [(float(r.sum()), len(r)) for r in runs]


def mean(totals: Sequence[tuple]) -> float:
    positions = sum(n for _, n in totals)
    return sum(a for a, _ in totals) / positions if positions else 0.0


def paired_margin(before: Sequence[tuple], after: Sequence[tuple]) -> float:
    """Two standard errors of the change in accepted drafts per round, paired by sequence (a ratio
    estimator over sequences: a sequence's positions are not independent of each other); inf with
    fewer than two sequences."""
    n = len(before)
    if n < 2:
        return float("inf")
    positions = np.array([p for _, p in before], np.float64)
    diffs = np.array([a for a, _ in after], np.float64) - np.array([b for b, _ in before], np.float64)
    change = diffs.sum() / positions.sum()
    return float(2 * np.sqrt(n / (n - 1) * ((diffs - change * positions) ** 2).sum()) / positions.sum())


class Pool:
    """The training windows (`seq` tokens each: every captured request's end, and stdlib replay) and
    their target features, computed once and kept within `cache_bytes`: a step after the first epoch
    costs only the drafter's. Batches go through the windows epoch by epoch in a seeded order, so a
    step's batch depends only on the step's number (a resumed run sees the same)."""

    def __init__(self, target, windows: Sequence[np.ndarray], batch: int, seed: int, cache_bytes: int = 1 << 30,
                 firsts: Optional[Sequence[int]] = None):
        self.target, self.windows, self.batch, self.seed = target, list(windows), batch, seed
        self.firsts = list(firsts) if firsts is not None else [1] * len(self.windows)
        self.cache: dict[int, tuple] = {}
        self.cache_bytes, self.cached_bytes = cache_bytes, 0

    def indices(self, step: int) -> list[int]:
        out, n = [], len(self.windows)
        for flat in range(step * self.batch, (step + 1) * self.batch):
            epoch, at = divmod(flat, n)
            out.append(int(np.random.default_rng([self.seed, epoch]).permutation(n)[at]))
        return out

    def start(self, step: int) -> int:
        """The first position step `step`'s loss is over: its windows' earliest first."""
        return min(self.firsts[i] for i in self.indices(step))

    def features(self, step: int) -> tuple:
        """Step `step`'s batch of target features: (embeds, hidden, labels, store K/V)."""
        rows = self.indices(step)
        missing = sorted({i for i in rows if i not in self.cache})
        fresh = {}
        if missing:
            embeds, hidden, labels, shared = distill.target_pass(self.target, mx.array(np.stack([self.windows[i]
                                                                                                for i in missing])))
            for r, i in enumerate(missing):
                fresh[i] = (embeds[r], hidden[r], labels[r], {k: (kv.keys[r], kv.values[r], kv.positions[r])
                                                              for k, kv in shared.items()})
                size = sum(a.nbytes for a in fresh[i][:3]) + sum(x.nbytes for kv in fresh[i][3].values() for x in kv)
                if self.cached_bytes + size <= self.cache_bytes:
                    self.cache[i], self.cached_bytes = fresh[i], self.cached_bytes + size
        got = [self.cache.get(i) or fresh[i] for i in rows]
        stack = lambda part: mx.stack([g[part] for g in got])  # noqa: E731
        shared = {kind: SharedKV(*(mx.stack([g[3][kind][j] for g in got]) for j in range(3))) for kind in got[0][3]}
        return stack(0), stack(1), stack(2), shared


class Ahead:
    """The pool's batches of target features in step order. With `on`, the next step's is computed on a
    thread of its own while the drafter trains on this one: on MLX's CPU backend a stream runs its work
    on one thread, so the target's forward and the drafter's step then take a core each (the same
    kernels on the same inputs: the features are bitwise the serial ones)."""

    def __init__(self, pool: Pool, on: bool):
        self.pool, self.pending = pool, None  # (step, future) computed ahead
        self.worker = concurrent.futures.ThreadPoolExecutor(1, "mlx_mtp-features", mark_mlx_thread) if on else None

    def get(self, step: int, then: Optional[int]) -> tuple:
        """Step `step`'s features; then start on step `then`'s (None: no next step)."""
        ready = self._take(step)
        got = ready if ready is not None else self.pool.features(step)
        if self.worker is not None and then is not None:
            self.pending = (then, self.worker.submit(self._computed, then))
        return got

    def close(self) -> None:
        self._take(None)
        if self.worker is not None:
            self.worker.shutdown(wait=True)

    def _take(self, step: Optional[int]) -> Optional[tuple]:
        """The features computed ahead if they are step `step`'s (waited for either way: the pool is
        one thread's at a time)."""
        if self.pending is None:
            return None
        (ahead, future), self.pending = self.pending, None
        got = future.result()
        return got if ahead == step else None

    def _computed(self, step: int) -> tuple:
        got = self.pool.features(step)
        mx.eval(got[:3], [tuple(kv) for kv in got[3].values()])  # here, on this thread's stream
        return got


class Adaptation:
    """One adaptation: a float copy of the drafter distilled on the captured requests, measured before
    and after on the held-out ones and the general sample (accepted drafts per greedy round of K).
    `work()` does it a piece at a time (a batch measured, a training step), so an engine can
    interleave it with requests; within `minutes`, measuring included."""

    def __init__(self, target, drafter_dir, records: Sequence[capture.Record], general: list, *, steps: int = 300,
                 seq: int = 128, batch: int = 4, lr: float = 1e-3, seed: int = 0, replay: Optional[np.ndarray] = None,
                 measure: int = 128, replies: bool = True, ahead: Optional[bool] = None):
        if len(records) < MIN_REQUESTS:
            raise ValueError(f"{len(records)} captured requests; adapting needs at least {MIN_REQUESTS}")
        drafter, self.config, _ = load_model(drafter_dir)
        if "quantization" in self.config:
            raise ValueError(f"{drafter_dir} is quantized; adapt an unquantized (bf16/fp32) drafter")
        self.dtype = drafter.model.embed_tokens.weight.dtype  # what the adapted one is saved in
        drafter.set_dtype(mx.float32)  # trained in fp32
        self.target, self.drafter = target, drafter
        train, held = split(records)
        self.held, self.general = Measure(target, [window(r, measure) for r in held]), Measure(target, general)
        windows = request_windows(train, seq)
        firsts = reply_starts(train, seq) if replies else [1] * len(windows)
        captured = len(windows)
        if replay is not None and len(replay) > seq:  # as much of what it was good at: it keeps it (no forgetting)
            starts = np.random.default_rng(seed).integers(0, len(replay) - seq, int(captured * REPLAY_SHARE))
            windows += [replay[s : s + seq] for s in starts]
            firsts += [int(np.median(firsts)) if replies else 1] * len(starts)  # as many positions as a request's
        self.pool = Pool(target, windows, batch, seed, firsts=firsts)
        # the next step's features on another core: where the CPU computes and has a core to spare
        self.ahead = mx.default_device() == mx.cpu and cpu_stream_count() > 1 if ahead is None else ahead
        self.distiller = distill.Distiller(target, drafter, None, steps=steps, k=K, seq=seq, batch=batch, lr=lr,
                                           seed=seed)
        self.requests, self.tokens = len(train), int(seq * len(windows))
        self.max_steps = steps
        self.before: Optional[dict] = None  # {"held_out": [(accepted, positions)...], "general": [...]}
        self.report: Optional[dict] = None  # the verdict's, once done
        self.phase, self.step_seconds = "measuring before", None
        self.measured, self.to_measure = 0, len(self.held) + len(self.general)
        self.times = {"train_target": 0.0, "train_drafter": 0.0}  # where the time goes, in the report
        self.started, self.budget = time.perf_counter(), None  # `work` sets them: its start, its seconds

    @property
    def trained(self) -> bool:
        return self.distiller.done >= self.distiller.steps

    def work(self, minutes: Optional[float] = None) -> Iterator[Optional[float]]:
        """Measure, train, measure again, within `minutes` (None: unbounded): the held-out requests
        measured are those that fit in MEASURE_SHARE of it (at least one batch), training stops when
        what is left only fits the measure after. Yields after each piece (a training step yields its
        loss), then sets `report`."""
        self.started = time.perf_counter()
        self.budget = None if minutes is None else 60 * minutes
        if self.before is None:  # a resumed adaptation keeps the measure of the drafter it started from
            self.before = yield from self._measure_before()
            self.times["measure_before"] = time.perf_counter() - self.started
        self.held.keep(len(self.before["held_out"]))  # the sample measured before, measured after
        self.phase = "training"
        yield None  # the phase's first line, before its first step
        yield from self._train()
        self.phase, self.measured, self.to_measure = "measuring after", 0, len(self.held) + len(self.general)
        began = time.perf_counter()
        after = {"held_out": [], "general": []}
        self.drafter.eval()
        for name, m in (("held_out", self.held), ("general", self.general)):
            for i in range(len(m.batches)):
                after[name] += m.run(self.drafter, i)
                self.measured += len(m.batches[i])
                yield None
        self.report = verdict(self.before, after)
        self.times["measure_after"] = time.perf_counter() - began
        self.times["measure_target"] = self.held.seconds["target"] + self.general.seconds["target"]
        self.times["measure_drafter"] = self.held.seconds["drafter"] + self.general.seconds["drafter"]
        self.report.update(k=K, steps=self.distiller.done, train_requests=self.requests, train_tokens=self.tokens,
                           times={k: round(v, 1) for k, v in self.times.items()})

    def _train(self) -> Iterator[float]:
        """Training steps while they fit; yields each one's loss. The target's time is what a step
        waited for its features (with them computed ahead, only what the drafter's step did not cover)."""
        ahead = Ahead(self.pool, self.ahead)
        try:
            yield from self._steps(ahead)
        finally:
            ahead.close()

    def _steps(self, ahead: Ahead) -> Iterator[float]:
        while not self.trained and self._time_for_a_step():
            self.drafter.train()
            began, done = time.perf_counter(), self.distiller.done
            features = ahead.get(done, done + 1 if done + 1 < self.distiller.steps else None)
            middle = time.perf_counter()
            loss = self.distiller.learn(features, self.pool.start(done))[0]
            took = time.perf_counter() - began
            self.times["train_target"] += middle - began
            self.times["train_drafter"] += took - (middle - began)
            self.step_seconds = took if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * took
            if self.budget is not None and self.distiller.done >= 2:  # the schedule: the steps that fit, as now timed
                fit = self.distiller.done + int(self._left() / self.step_seconds)
                self.distiller.steps = max(self.distiller.done, min(self.max_steps, fit))
            yield loss

    def _measure_before(self) -> Iterator[None]:
        self.drafter.eval()
        out = {"held_out": [], "general": []}
        for i in range(len(self.general.batches)):
            out["general"] += self.general.run(self.drafter, i)
            self.measured += len(self.general.batches[i])
            yield None
        took = 0.0
        for i in range(len(self.held.batches)):
            spent = time.perf_counter() - self.started
            if i >= 1 and self.budget is not None and spent + took > MEASURE_SHARE * self.budget:
                self.to_measure = self.measured
                break  # a bounded sample: the rest of the time trains
            out["held_out"] += self.held.run(self.drafter, i)
            took = time.perf_counter() - self.started - spent
            self.measured += len(self.held.batches[i])
            yield None
        return out

    def _after_seconds(self) -> float:
        """What measuring again will take: the drafter's share of measuring before."""
        m = self.held.seconds["drafter"] + self.general.seconds["drafter"]
        return 1.2 * m + 1.0

    def _left(self) -> float:
        return self.budget - (time.perf_counter() - self.started) - self._after_seconds()

    def _time_for_a_step(self) -> bool:
        return self.budget is None or self._left() > (self.step_seconds or 0.0)

    def eta(self) -> Optional[float]:
        """Seconds the run has left, as now estimated (None: not yet known): a bounded run fills its
        time unless it runs out of steps."""
        left = None if self.budget is None else max(0.0, self.budget - (time.perf_counter() - self.started))
        if self.phase == "measuring before" or (self.phase == "training" and self.step_seconds is None):
            return left
        rest = self._after_seconds() * (1 - self.measured / max(self.to_measure, 1))
        if self.phase == "training":
            rest = self._after_seconds() + self.step_seconds * (self.distiller.steps - self.distiller.done)
        return rest if left is None else min(rest, left)


def request_windows(records: Sequence[capture.Record], seq: int) -> list[np.ndarray]:
    """A `seq`-token window ending at each request's last token, from the requests one after another
    (a short request's window holds the end of the one before)."""
    stream = np.concatenate([r.tokens for r in records])
    ends = np.cumsum([len(r.tokens) for r in records])
    seq = min(seq, len(stream))
    return [stream[e - seq : e] for e in ends if e >= seq]


def reply_starts(records: Sequence[capture.Record], seq: int) -> list[int]:
    """Where the reply begins in each of `request_windows`' windows (1 where the window is all reply; at
    most half-way: a short reply's window trains on the prompt's end too): a request's reply is what
    serving drafts, the prompt's tokens before it are there as the target's context."""
    ends = np.cumsum([len(r.tokens) for r in records])
    seq = min(seq, int(ends[-1])) if len(ends) else seq
    return [min(max(1, seq - len(r.reply)), seq // 2) for r, e in zip(records, ends) if e >= seq]


def verdict(before: dict, after: dict) -> dict:
    """The means before and after, the changes' noise margins (`paired_margin`), and `better`: held-out
    acceptance up by more than its margin, the general sample's down by at most GENERAL_DROP beyond its."""
    b = {name: mean(t) for name, t in before.items()}
    a = {name: mean(after[name]) for name in before}
    margin = paired_margin(before["held_out"], after["held_out"])
    general_margin = paired_margin(before["general"], after["general"])
    better = (a["held_out"] - b["held_out"] > margin
              and a["general"] >= b["general"] * (1 - GENERAL_DROP) - general_margin)
    return dict(before=b, after=a, margin=margin, general_margin=general_margin, better=better,
                held_out_requests=len(before["held_out"]), general_sequences=len(before["general"]))


def window(r: capture.Record, size: int) -> tuple[np.ndarray, int]:
    """(ids, first): at most `size` tokens of a request to measure on: its reply, after as much of the
    prompt's end as fits (at least a quarter of `size`, where the prompt has it)."""
    context = min(len(r.prompt), max(size - len(r.reply), size // 4))
    return r.tokens[len(r.prompt) - context : len(r.prompt) + size - context], context


def say(report: dict) -> str:
    b, a = report["before"], report["after"]
    change = a["held_out"] - b["held_out"]
    return (f"accepted drafts per round (K={report['k']}): held-out {b['held_out']:.3f} -> {a['held_out']:.3f} "
            f"({_change(b['held_out'], a['held_out'])}; {change:+.3f}, noise margin {report['margin']:.3f}: two "
            f"standard errors paired over {report['held_out_requests']} held-out requests), general "
            f"{b['general']:.3f} -> {a['general']:.3f} ({_change(b['general'], a['general'])}; noise margin "
            f"{report['general_margin']:.3f})")


def where_the_time_went(report: dict) -> str:
    t = report["times"]
    before = f"measuring before {t['measure_before']:.0f} s, " if "measure_before" in t else ""
    return (f"{report['seconds']:.0f} s: {before}training {report['steps']} steps "
            f"{t['train_target'] + t['train_drafter']:.0f} s (waiting for the target's features "
            f"{t['train_target']:.0f} s, the drafter's steps {t['train_drafter']:.0f} s), measuring after {t['measure_after']:.0f} s; measuring "
            f"took the target {t['measure_target']:.0f} s and the drafter {t['measure_drafter']:.0f} s")


def _change(before: float, after: float) -> str:
    return f"{100 * (after - before) / before:+.1f}%" if before else "from 0"


def adapt(target, drafter_dir, records, general, out: Path, *, steps: int = 300, seq: int = 128, batch: int = 4,
          lr: float = 1e-3, seed: int = 0, minutes: Optional[float] = None, checkpoint_every: int = 25,
          replay: Optional[np.ndarray] = None, progress: Callable[[str], None] = print, replies: bool = True,
          ahead: Optional[bool] = None) -> dict:
    """Adapt within `minutes` (None: unbounded), resuming from `out`.partial if a run with these inputs
    stopped there; write `out` only if the adapted drafter is better. `replies`: the loss over each
    window's reply (else every position); `ahead`: the next step's features on a thread of their own
    (None: on a CPU with a core to spare). Returns the report (with `written`)."""
    out = Path(out)
    check_out(out, drafter_dir)
    a = Adaptation(target, drafter_dir, records, general, steps=steps, seq=seq, batch=batch, lr=lr, seed=seed,
                   replay=replay, measure=seq, replies=replies, ahead=ahead)
    partial = out.with_name(out.name + ".partial")
    key = _key(drafter_dir, records, steps, seq, batch, lr, seed, replies)
    info = json.loads((partial / "state.json").read_text()) if (partial / "state.json").exists() else {}
    if info.get("key") == key:
        a.distiller.restore(mx.load(str(partial / "state.safetensors")), info)
        a.before = {name: [tuple(t) for t in totals] for name, totals in info["before"].items()}
        progress(f"resuming at step {a.distiller.done} of {a.distiller.steps} ({partial})")
    else:
        progress(f"measuring the drafter on {len(a.general)} general sequences and up to {len(a.held)} held-out "
                 f"requests" + (f" (at most {MEASURE_SHARE:.0%} of {minutes:.1f} minutes), then training" if minutes
                                else ", then training"))
    started, bar = time.perf_counter(), Progress(a, progress)
    for loss in a.work(minutes):
        bar.show(loss)
        if loss is not None and a.distiller.done % checkpoint_every == 0 and not a.trained:
            _checkpoint(a.distiller, partial, {"key": key, "before": a.before})
    bar.close()
    report = dict(a.report, seconds=round(time.perf_counter() - started, 1), written=a.report["better"], out=str(out))
    progress(where_the_time_went(report))
    if report["written"]:
        distill.save_drafter(a.drafter, a.config, out, extra=report, dtype=a.dtype)
        progress(f"wrote {out}: {say(report)}")
    else:
        progress(f"not written: the adapted drafter is not better ({say(report)}; held-out must rise by more than "
                 f"its margin, general fall at most {100 * GENERAL_DROP:.0f}% beyond its)")
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
    """The run's progress line from its first piece: the phase, how far, the time spent and an estimate
    of the time left (the adaptation's `eta`). Redrawn in place on a terminal (every second at most);
    otherwise a line at each phase's start and every tenth of the training."""

    def __init__(self, adaptation: Adaptation, out: Callable[[str], None]):
        self.a, self.out, self.started = adaptation, out, time.perf_counter()
        self.drawn, self.phase, self.said, self.loss = 0.0, None, -1, None
        self.last = self.printed = None  # the latest line made, and printed (not on a terminal)
        self.tty = sys.stderr.isatty()

    def line(self) -> str:
        a, elapsed = self.a, time.perf_counter() - self.started
        eta = a.eta()
        left = "estimating the time left" if eta is None else f"~{eta:.0f} s left"
        if a.phase == "training":
            d = a.distiller
            where = (f"[{'#' * (20 * d.done // max(d.steps, 1)):<20}] step {d.done}/{d.steps}"
                     + (f", loss {self.loss:.3f}" if self.loss is not None else ""))
        else:
            where = f"{a.phase}: {a.measured} of {a.to_measure} sequences"
        return f"{where}, {elapsed:.0f} s, {left}"

    def show(self, loss: Optional[float]) -> None:
        self.loss = loss if loss is not None else self.loss
        now, a = time.perf_counter(), self.a
        if self.tty:
            if now - self.drawn >= 1.0 or a.phase != self.phase:
                print("\r\033[K" + self.line(), end="", file=sys.stderr, flush=True)
                self.drawn, self.phase = now, a.phase
            return
        tenth = 10 * a.distiller.done // max(a.distiller.steps, 1) if a.phase == "training" else -1
        if self.phase == "training" and a.phase != "training" and self.last != self.printed:
            self.out(self.last)  # training's last step, before the next phase's line
        line = self.line()
        if a.phase != self.phase or tenth > self.said or (a.phase != "training" and now - self.drawn >= 30):
            self.out(line)
            self.phase, self.said, self.drawn, self.printed = a.phase, tenth, now, line
        self.last = line

    def close(self) -> None:
        if self.tty:
            print("\r\033[K" + self.line(), file=sys.stderr, flush=True)


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
                                             seq=self.seq, batch=self.batch, measure=self.seq, replay=replay,
                                             ahead=False)  # no target forward beside the requests' own
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


def parser() -> argparse.ArgumentParser:
    """The command line; every option says its default."""
    ap = argparse.ArgumentParser(prog=prog_name("mlx_mtp.learn"), description=__doc__.splitlines()[0])
    ap.add_argument("captures", metavar="DIR", help="captured requests (the server's --learn-dir)")
    ap.add_argument("--target", help="the target model dir or hub id (frozen; default: the bundled demo pair's)")
    ap.add_argument("--drafter", help="the MTP drafter to adapt (unquantized; never written to; default: the "
                                      "demo pair's, without --target)")
    ap.add_argument("--out", required=True, help="where the adapted drafter goes, if it is better")
    ap.add_argument("--minutes", type=float, default=15.0,
                    help="the whole run's time, measuring before and after included: the held-out requests "
                         f"measured are those that fit in {100 * MEASURE_SHARE:.0f}%% of it, training gets the rest "
                         "(default: 15; 0: no bound, all held-out requests and every step)")
    ap.add_argument("--steps", type=int, default=300, help="training steps at most (default: 300)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per training and measured window: a request's "
                                                         "reply and the end of its prompt (default: 128)")
    ap.add_argument("--batch", type=int, default=4, help="windows per training step (default: 4)")
    ap.add_argument("--train-on", choices=("replies", "all"), default="replies",
                    help="the positions a window's loss is over: its reply's (the prompt's end before it only the "
                         "target's context; half the drafter's work) or all (default: replies)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, AdamW (default: 1e-3)")
    ap.add_argument("--seed", type=int, default=0, help="of the windows' order and the replay's (default: 0)")
    ap.add_argument("--general", nargs="+", help="text files or .npy ids it must stay good at (default: 8 modules "
                                                  "of the Python standard library)")
    ap.add_argument("--replay", nargs="+", help="text files or .npy ids of what it was trained on, a third as many "
                                                 "windows as the requests' mixed into training, so that it keeps "
                                                 "it (default: 18 other modules of the standard library)")
    ap.add_argument("--no-replay", action="store_true", help="train on the captured requests alone (default: off)")
    ap.add_argument("--max-tokens", type=int, default=20_000_000,
                    help="the newest captured tokens read (bounds memory: 4 bytes each; default: 20000000)")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()  # --minutes bounds the whole run: reading and loading too
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
        minutes = args.minutes - (time.perf_counter() - started) / 60 if args.minutes else None
        print(f"{len(records)} captured requests; adapting {args.drafter} for at most {args.steps} steps"
              + (f" within {args.minutes:g} minutes" if minutes else ""), flush=True)
        adapt(target, args.drafter, records, general, Path(args.out), steps=args.steps, seq=args.seq,
              batch=args.batch, lr=args.lr, seed=args.seed, minutes=minutes, replay=replay,
              progress=lambda s: print(s, flush=True), replies=args.train_on == "replies")
    except (OSError, ValueError) as e:
        print(error_line(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
