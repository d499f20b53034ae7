"""mlx-lm's plain decoding and mlx-vlm's Gemma 4 MTP on the weights ours runs, beside ours, at
B = 1 and 4: greedy, the decode phase timed (after each one's first token), after a warm-up run.

mlx-lm: `generate_step` at B = 1, its `BatchGenerator` at B > 1. mlx-vlm: `generate_step` with
the assistant as an `mtp` drafter, `draft_block_size` K + 1 (the drafts and the bonus token),
its batched rounds at B > 1. Ours: `BatchGenerator` with the assistant at K. A peer that cannot
run here is skipped with one line saying why: mlx-vlm is no dependency of mlx_mtp (`pip install
mlx-vlm` to compare), and mlx-lm's MoE experts (GatherMM) take float32 only on the CPU; any other
failure is reported with its one-line error.
"""

from __future__ import annotations

import gc
import time

import mlx.core as mx

from . import inmemory
from .oracle import JoinTogether, decode_run

BATCHES = (1, 4)


def mlxlm_decode(model, prompts: list, n: int) -> dict:
    """mlx-lm's greedy plain decoding of the rows together."""
    if len(prompts) == 1:
        from mlx_lm.generate import generate_step

        stream = ([int(t)] for t, _ in generate_step(mx.array(prompts[0]), model, max_tokens=n))
    else:
        stream = _mlxlm_batch(model, prompts, n)
    return _timed(stream, len(prompts))


def _mlxlm_batch(model, prompts: list, n: int):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n, stop_tokens=[])
    uids = gen.insert(prompts, [n] * len(prompts))
    try:
        while responses := gen.next_generated():
            by_uid = {r.uid: r.token for r in responses}
            yield [by_uid.get(u) for u in uids]
    finally:
        gen.close()


def mlxvlm_decode(model, drafter, prompts: list, n: int, k: int) -> dict:
    """mlx-vlm's greedy MTP decoding of the rows together (equal-length prompts)."""
    from mlx_vlm.generate.ar import generate_step

    stream = generate_step(mx.array(prompts), model, None, None, max_tokens=n, temperature=0.0,
                           draft_model=drafter, draft_kind="mtp", draft_block_size=k + 1)
    rows = ([t] if isinstance(t, int) else t for t, _ in stream)
    return _timed(rows, len(prompts))


def _timed(steps, rows: int) -> dict:
    """Tokens per row from a stream of per-row token lists (None: nothing for that row), and the
    decode phase's tok/s (from the first tokens to the last)."""
    out = [[] for _ in range(rows)]
    first = None
    for step in steps:
        for row, token in zip(out, step):
            if token is not None:
                row.append(int(token))
        if first is None:
            first = time.perf_counter()
    seconds = time.perf_counter() - first
    decoded = sum(len(r) for r in out) - rows
    return dict(tokens=out, tok_s=decoded / seconds if seconds > 0 else None)


def ours_mtp(target, drafter, prompts: list, n: int, k: int) -> dict:
    gen = JoinTogether(target, drafter, draft_tokens=k)
    decode_run(gen, prompts, min(n, 12))  # warm-up
    run = decode_run(gen, prompts, n)
    return dict(tokens=run["tokens"], tok_s=run["decoded"] / run["seconds"])


def compare(target, drafter, target_weights: tuple, drafter_weights: tuple, prompts: list, plain: dict,
            k: int, tokens, log) -> dict:
    """Each peer's tok/s at B = 1 and 4 and ours beside it; `plain[B]` is our plain run at B (its
    tokens and tok/s); `tokens(B)` the new tokens per row."""
    out = dict(mlx_lm_plain={}, mlx_vlm_mtp={}, ours_mtp={}, equals_ours_plain={})
    for B in BATCHES:
        out["ours_mtp"][B] = ours_mtp(target, drafter, prompts[:B], tokens(B), k)["tok_s"]
    try:
        model = inmemory.mlxlm_model(*target_weights)
        for B in BATCHES:
            mlxlm_decode(model, prompts[:B], 4)  # warm-up
            run = mlxlm_decode(model, prompts[:B], tokens(B))
            out["mlx_lm_plain"][B] = run["tok_s"]
            out["equals_ours_plain"][f"mlx-lm B={B}"] = run["tokens"] == plain[B]["tokens"]
        del model
    except Exception as e:  # a peer's failure is a finding, not the end of the suite
        out["mlx_lm_skipped" if "GatherMM" in str(e) else "mlx_lm_error"] = _one_line(e)
    gc.collect()
    try:
        model, draft = inmemory.mlxvlm_pair(target_weights, drafter_weights)
        for B in BATCHES:
            mlxvlm_decode(model, draft, prompts[:B], 4, k)  # warm-up
            run = mlxvlm_decode(model, draft, prompts[:B], tokens(B), k)
            out["mlx_vlm_mtp"][B] = run["tok_s"]
            out["equals_ours_plain"][f"mlx-vlm B={B}"] = run["tokens"] == plain[B]["tokens"]
        del model, draft
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "mlx_vlm":
            out["mlx_vlm_skipped"] = "mlx-vlm is not installed (pip install mlx-vlm to compare)"
        else:
            out["mlx_vlm_error"] = _one_line(e)
    gc.collect()
    mx.clear_cache()
    out["plain_over_mlx_lm"] = {B: plain[B]["mean_tok_s"] / v for B, v in out["mlx_lm_plain"].items() if v}
    out["mtp_over_mlx_vlm"] = {B: out["ours_mtp"][B] / v for B, v in out["mlx_vlm_mtp"].items() if v}
    log(f"  peers: mlx-lm plain {pair_text(out, 'mlx_lm_plain')} tok/s, mlx-vlm MTP K={k} "
        f"{pair_text(out, 'mlx_vlm_mtp')}, ours MTP {pair_text(out, 'ours_mtp')}"
        + "".join(f"; {out[e]}" for e in ("mlx_lm_error", "mlx_vlm_error") if e in out))
    if "mlx_lm_skipped" in out:
        log(f"  mlx-lm: skipped on {mx.default_device()}: its MoE experts take float32 only here "
            f"({out['mlx_lm_skipped']})")
    if "mlx_vlm_skipped" in out:
        log(f"  mlx-vlm: skipped: {out['mlx_vlm_skipped']}")
    return out


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def pair_text(peers: dict, key: str, unit: str = "") -> str:
    """`key`'s values at B = 1 and 4, or '-' where there is none."""
    values = peers.get(key) or {}
    spec = ".2f" if unit else ".1f"
    return ", ".join(f"{values[B]:{spec}}{unit}" if values.get(B) else "-" for B in BATCHES)


def figures(peers: dict, k: int) -> dict:
    """The comparison's table rows (figure -> text)."""
    return {"mlx-lm plain B=1, B=4 (tok/s)": pair_text(peers, "mlx_lm_plain"),
            "ours plain / mlx-lm plain, B=1, B=4": pair_text(peers, "plain_over_mlx_lm", "x"),
            f"mlx-vlm MTP K={k} B=1, B=4 (tok/s)": pair_text(peers, "mlx_vlm_mtp"),
            f"ours MTP K={k} B=1, B=4 (tok/s)": pair_text(peers, "ours_mtp"),
            "ours MTP / mlx-vlm MTP, B=1, B=4": pair_text(peers, "mtp_over_mlx_vlm", "x")}
