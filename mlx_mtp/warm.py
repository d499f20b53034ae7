"""Compile, ahead of use, every kernel a model's requests will need (`mlx-mtp-selftest --warm MODEL`).

MLX builds its kernels the first time each shape meets them (NVRTC on the CUDA backend: some take tens
of seconds), and keeps them on disk for later runs. Warming runs the shapes a serving process meets:
a prompt of more than one prefill chunk, then decode steps and verifies of every draft length at every
batch size, so that a machine image, or a first run, carries them all.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from . import jit
from .batch import BatchGenerator
from .loading import Loaded
from .speculative import K_MAX

PROMPT = 600  # tokens of the one long prompt: a whole prefill chunk of 512 and a remainder
SHORT = 16  # tokens of the others


def warm(loaded: Loaded, batches: Iterable[int] = range(1, 9), log: Callable[[str], None] = print) -> dict:
    """Run a long prefill, then at each batch size plain decoding and verifies of each draft length
    1..K_MAX (with a drafter); returns what was run, the kernels MLX compiled meanwhile and the seconds."""
    folder, started = jit.kernel_dir(), time.perf_counter()
    before = jit.count(folder)
    context = loaded.target.config.max_position_embeddings
    ids = [3 + i % (loaded.target.vocab_size - 3) for i in range(min(PROMPT, context // 2))]
    lengths = range(K_MAX + 1) if loaded.drafter is not None else range(1)
    run([ids], loaded, 0, 1)
    runs = 1
    for B in batches:
        for k in lengths:  # rows of different lengths, as a batch has them
            run([ids[row : row + SHORT + row] for row in range(B)], loaded, k, 3 * (k + 1))
            runs += 1
        log(f"B={B}: plain steps" + (f" and verifies of K = 1..{lengths[-1]}" if lengths[-1] else "") + " run "
            f"({jit.count(folder) - before} kernels compiled so far, {time.perf_counter() - started:.0f} s)")
    return dict(runs=runs, compiled=jit.count(folder) - before, seconds=time.perf_counter() - started)


def run(prompts: list, loaded: Loaded, k: int, max_tokens: int) -> None:
    gen = BatchGenerator(loaded.target, loaded.drafter if k else None, draft_tokens=k)
    for prompt in prompts:
        gen.insert(prompt, max_tokens=max_tokens)
    while gen.busy:
        gen.step()
