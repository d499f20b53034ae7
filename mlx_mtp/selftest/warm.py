"""Compile, ahead of use, every kernel a model's requests will need (`mlx-mtp-selftest --warm MODEL`).

MLX builds its kernels the first time each shape meets them (NVRTC on the CUDA backend: some take tens
of seconds), and keeps them on disk for later runs. Warming runs the shapes a serving process meets:
a prompt of more than one prefill chunk, then decode steps and verifies of every draft length at every
batch size, so that a machine image, or a first run, carries them all.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from ..runtime import jit
from ..decode.batch import BatchGenerator
from ..loading import Loaded
from ..decode.speculative import K_MAX

PROMPT = 600  # tokens of the one long prompt: a whole prefill chunk of 512 and a remainder
SHORT = 16  # tokens of the others


def warm(loaded: Loaded, batches: Iterable[int] = range(1, 9), log: Callable[[str], None] = print) -> dict:
    """Run a long prefill, then at each batch size plain decoding and verifies of each draft length
    1..K_MAX, and plain steps and verifies in turn (`Cycle`), with a drafter; returns what was run, the
    kernels MLX compiled meanwhile and the seconds."""
    folder, started = jit.kernel_dir(), time.perf_counter()
    before = jit.count(folder)
    context = loaded.target.config.max_position_embeddings
    ids = [3 + i % (loaded.target.vocab_size - 3) for i in range(min(PROMPT, context // 2))]
    lengths = range(K_MAX + 1) if loaded.drafter is not None else range(1)
    run([ids], loaded, 0, 1)
    runs = 1
    for B in batches:
        for k in [*lengths, *([Cycle()] if loaded.drafter is not None else [])]:  # rows of different lengths
            tokens = 3 * (k + 1) if isinstance(k, int) else 4 * (K_MAX + 1)
            run([ids[row : row + SHORT + row] for row in range(B)], loaded, k, tokens)
            runs += 1
        drafted = f" and verifies of K = 1..{lengths[-1]} run, and in turn" if lengths[-1] else " run"
        log(f"B={B}: plain steps{drafted} ({jit.count(folder) - before} kernels compiled so far, "
            f"{time.perf_counter() - started:.0f} s)")
    return dict(runs=runs, compiled=jit.count(folder) - before, seconds=time.perf_counter() - started)


def run(prompts: list, loaded: Loaded, k, max_tokens: int) -> None:
    """The prompts generated together with draft length `k` (an int, or a `Cycle`)."""
    gen = BatchGenerator(loaded.target, loaded.drafter if k else None, draft_tokens=k if isinstance(k, int) else "auto")
    if isinstance(k, Cycle):
        cycling(gen, k)
    for prompt in prompts:
        gen.insert(prompt, max_tokens=max_tokens)
    while gen.busy:
        gen.step()


class Cycle:
    """A draft policy for warming up: a plain step before every draft length and after it, in turn, as
    `auto` may order them. A round after a drafted one runs on a cache rolled back on the device (its
    writes scattered, not sliced): shapes that runs of one fixed draft length never build for a plain
    step, nor for a drafted round after a plain step."""

    fixed = None  # what a generator's own policy says: not one fixed length

    def __init__(self, k_max: int = K_MAX):
        self.order = [k for d in range(1, k_max + 1) for k in (0, d)]
        self.at = 0

    def choose(self, rows: int, members=()) -> int:
        self.at += 1
        return self.order[(self.at - 1) % len(self.order)]

    def observe(self, *args, **kwargs) -> None:
        pass


def cycling(gen: BatchGenerator, cycle: Cycle) -> BatchGenerator:
    """`gen` with its rounds' draft lengths from `cycle` (a warm-up; the drafter's own policy untaught)."""
    gen.policy = gen.constrained_policy = cycle
    return gen


def every_length(prompts: list, loaded: Loaded, max_tokens: int) -> None:
    """Build every shape a decoding batch of these prompts meets whatever `auto` picks: each fixed draft
    length 0..K_MAX, then a cycle of plain steps and drafted rounds."""
    lengths = range(K_MAX + 1) if loaded.drafter is not None else range(1)
    for k in lengths:
        run(prompts, loaded, k, max_tokens)
    if loaded.drafter is not None:  # long enough for the whole cycle, however few drafts are accepted
        run(prompts, loaded, Cycle(), max(max_tokens, 4 * (K_MAX + 1)))
