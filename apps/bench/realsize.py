"""Real size: a released Gemma 4 shape (26B-A4B, 31B, E4B, E2B) with random weights, quantized,
through the product's own loader and driver.

The checkpoint pair (target and MTP assistant) is written once into a cache directory by the
converter's shapes-only plan and shard writer (`convert.plan(..., shapes_only=True,
quantize=True)`, `convert.write_weights`) from the configs committed under
tests/fixtures/real_configs. Then, measured: load time and memory; prefill tok/s (time to the
first token through `BatchGenerator`); plain decode tok/s at B rows and the MoE expert union per
layer; MTP with a controlled-acceptance oracle (each draft right with probability p, the real
assistant's cost paid) against plain decoding at B rows, its round cost in plain steps, and
whether its output equals plain greedy decoding; K/V memory at a long context (the cache filled
with random K/V, then one decode step over it); for a centroid assistant (E2B/E4B), its sparse
head against the full 262144-row head. Random weights: speed and memory are real, the text is not.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from convert.convert import plan, write_weights
from mlx_mtp.cache.kv import FULL
from mlx_mtp.decode.drafters import MTPProposer
from mlx_mtp.loading import load
from mlx_mtp.models import moe
from mlx_mtp.models.base import cpu_stream_count, using_streams
from mlx_mtp.models.quantized import dequantize_rows
from mlx_mtp.decode.speculative import MAX_ROLLBACK

from .cost import ASSISTANTS, CONFIGS, TARGETS, TINY
from .env import median, reset_peak_rss, rss_gib, time_fn
from .oracle import JoinTogether, RowsOracle, decode_run, expected_tokens, first_token
from .report import fmt, section, table

SHAPES = (*TARGETS, "tiny")
CACHE = Path("~/.cache/mlx_mtp/realsize").expanduser()
SHARD_BYTES = 2 << 30  # smaller shards than the converter's 5 GB: less held while writing
CHUNK_BYTES = 1 << 30  # random fp32 drawn at once, at most
GROUP = 64  # quantization group size of the checkpoints (the converter's default)
_ORDERING = "masked_embedding.token_ordering"


def sources(shape: str) -> tuple[dict, dict, str]:
    """(target config, assistant config, where the assistant's comes from)."""
    if shape == "tiny":
        read = lambda kind: json.loads((TINY / "moe" / kind / "config.json").read_text())  # noqa: E731
        return read("target"), read("drafter"), "tiny MoE fixture pair"
    target = json.loads((CONFIGS / TARGETS[shape] / "config.json").read_text())
    path, provenance = ASSISTANTS[shape]
    assistant = json.loads(path.read_text())
    assistant.pop("_partial", None)
    return target, assistant, f"{path.relative_to(CONFIGS.parents[2])}: {provenance}"


def checkpoint(shape: str, bits: int, root: Path, log) -> dict:
    """The pair's directories under `root`, written unless already there."""
    target_config, assistant_config, provenance = sources(shape)
    base = root / f"{shape}-{bits}bit"
    info = dict(dir=str(base), assistant_config=provenance, written={})
    for name, config, seed in (("target", target_config, 0), ("assistant", assistant_config, 1)):
        out = base / name
        if not (out / "config.json").exists():
            info["written"][name] = write_model(config, out, bits, seed, log)
        info[f"{name}_gb"] = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**30
    return info


def write_model(config: dict, out: Path, bits: int, seed: int, log) -> dict:
    """Random weights of `config`'s shapes, quantized to `bits` (a centroid head's token order a
    random permutation), written through a temporary directory renamed into place."""
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "source").mkdir(parents=True)
    (tmp / "source" / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    reset_peak_rss()
    started = time.perf_counter()
    _, out_config, weights = plan(tmp / "source", shapes_only=True, quantize=bool(bits), bits=bits or None,
                                  quantize_drafter=True, dtype="bfloat16", progress=False)
    if _ORDERING in weights:
        weights[_ORDERING] = mx.random.permutation(weights[_ORDERING].size).astype(mx.int32)
    for key in [k for k, v in weights.items() if k.endswith(".scales") and 4 * v.size * GROUP > CHUNK_BYTES]:
        _in_row_chunks(weights, key[: -len(".scales")])
    log(f"writing {out} ({sum(v.nbytes for v in weights.values()) / 2**30:.2f} GiB)")
    write_weights(tmp, weights, SHARD_BYTES, progress=True)
    (tmp / "config.json").write_text(json.dumps(out_config, indent=2))
    shutil.rmtree(tmp / "source")
    os.replace(tmp, out)
    return dict(seconds=time.perf_counter() - started, peak_rss_gib=rss_gib("VmHWM"))


def _in_row_chunks(weights: dict, name: str) -> None:
    """Re-draw a huge quantized tensor (E2B/E4B's 262144 x layers*256 per-layer embedding table
    is 9-11 GiB in fp32 at once) a block of rows at a time; its shape and format are unchanged."""
    w, scales = weights[name + ".weight"], weights[name + ".scales"]
    dims = scales.shape[-1] * GROUP
    layer_bits = w.shape[-1] * 32 // dims
    rows = max(1, CHUNK_BYTES // (4 * dims))
    parts = []
    for start in range(0, w.shape[0], rows):
        block = mx.random.normal((min(rows, w.shape[0] - start), dims), scale=dims ** -0.5).astype(mx.bfloat16)
        parts.append(mx.quantize(block, GROUP, layer_bits))
        mx.eval(parts[-1])
    for i, suffix in enumerate((".weight", ".scales", ".biases")):
        weights[name + suffix] = mx.concatenate([p[i] for p in parts])


def figure(**values) -> dict:
    """A measured figure with the machine's load average and this process's peak RSS since the
    previous figure beside it."""
    peak = rss_gib("VmHWM")
    reset_peak_rss()
    return dict(values, loadavg=round(os.getloadavg()[0], 2), peak_rss_gib=round(peak, 2))


def measure_load(base: Path, log) -> tuple:
    mx.clear_cache()
    reset_peak_rss()
    started = time.perf_counter()
    loaded = load(base / "target", base / "assistant")
    seconds = time.perf_counter() - started
    res = figure(seconds=seconds, rss_gib=rss_gib(), mlx_active_gib=mx.get_active_memory() / 2**30)
    log(f"load: {seconds:.1f} s, RSS {res['rss_gib']:.2f} GiB (peak {res['peak_rss_gib']:.2f})")
    return loaded, res


def measure_prefill(target, lengths: list, rng, log) -> dict:
    """Seconds to the first token of a `length`-token prompt, one row (the driver's chunks)."""
    out = {}
    for n in lengths:
        seconds = first_token(target, rng.integers(4, target.vocab_size, n).tolist())
        out[n] = figure(seconds=seconds, tok_s=n / seconds)
        log(f"prefill {n} tokens: {seconds:.1f} s ({n / seconds:.2f} tok/s, {_at(out[n])})")
    return out


def uniform_union(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts if every token picked top_k of `experts` uniformly at random."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def expert_unions(record: list, layers: int, tokens: int) -> list:
    """Distinct experts per MoE layer in each forward of `tokens` tokens (not the prompts'), from
    `moe.ROUTER_RECORD`."""
    per_forward = [record[i: i + layers] for i in range(0, len(record), layers)]
    return [[len(np.unique(np.array(idx))) for idx in forward] for forward in per_forward
            if forward[0].size == tokens * forward[0].shape[-1]]


def measure_plain(target, prompts: list, batches: list, tokens: dict, log) -> dict:
    """Plain greedy decoding of B rows, prompts prefilled in the run (the decode phase timed; a
    cache per row kept across runs would hold 0.2 GiB of sliding rings per row at 26B-A4B);
    expert unions of its forwards."""
    cfg, out = target.config, {}
    for B in batches:
        moe.ROUTER_RECORD = [] if cfg.enable_moe_block else None
        run = decode_run(JoinTogether(target), prompts[:B], tokens[B])
        unions = expert_unions(moe.ROUTER_RECORD or [], cfg.num_hidden_layers, B)
        moe.ROUTER_RECORD = None
        step = median(run["step_seconds"])
        out[B] = figure(tok_s=B / step, step_s=step, mean_tok_s=run["decoded"] / run["seconds"],
                        tokens=run["tokens"], decoded=run["decoded"],
                        union_per_layer=np.mean(unions, axis=0).round(1).tolist() if unions else None,
                        union_mean=float(np.mean(unions)) if unions else None,
                        uniform_union=uniform_union(cfg.num_experts, cfg.top_k_experts, B) if unions else None)
        log(f"plain B={B}: {out[B]['tok_s']:.3f} tok/s ({out[B]['step_s']:.1f} s/step"
            + (f", expert union {out[B]['union_mean']:.1f}" if unions else "") + f", {_at(out[B])})")
    return out


def measure_mtp(target, drafter, prompts, plain: dict, k: int, p: float, batches: list, log) -> dict:
    """MTP with the oracle (per-row truth: that row's plain output) at B rows, the real drafter's
    cost paid; the output checked against plain decoding's."""
    out = {}
    for B in batches:
        truths = plain[B]["tokens"]
        oracle = RowsOracle(truths, [len(x) for x in prompts[:B]], target.vocab_size, p,
                            MTPProposer(drafter, target))
        gen = JoinTogether(target, oracle, draft_tokens=k)
        oracle.start(gen, seed=0)
        run = decode_run(gen, prompts[:B], len(truths[0]))
        diverged = [next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
                    for got, want in zip(run["tokens"], truths)]
        base = plain[B]
        out[B] = figure(tok_s=run["decoded"] / run["seconds"], round_s=median(run["step_seconds"]),
                        speedup=(run["decoded"] / run["seconds"]) / base["mean_tok_s"],
                        round_in_plain_steps=median(run["step_seconds"]) / base["step_s"],
                        tokens_per_row_round=run["decoded"] / (B * run["steps"]),
                        expected_tokens=expected_tokens(p, k), equals_plain=all(d is None for d in diverged),
                        first_divergence=diverged, tokens=len(truths[0]))
        log(f"MTP K={k} p={p} B={B}: {out[B]['tok_s']:.3f} tok/s, {out[B]['speedup']:.2f}x plain, round = "
            f"{out[B]['round_in_plain_steps']:.2f} plain steps, equals plain: {out[B]['equals_plain']} "
            f"({_at(out[B])})")
    return out


def measure_steps(target, drafter, batches: list, mtp_batches: list, k: int, repeats: int, rng, log) -> dict:
    """Forward costs interleaved within each repeat (the machine's load hits every case alike), in
    groups that hold few rows of K/V at once: a decode step of B rows beside one of one row, and
    at each MTP batch a decode step, a K+1-token verify and a draft step. Ratios are medians of
    within-repeat ratios: B rows / one row, and a round in plain steps."""
    groups = [[(1, 1), (B, 1)] for B in batches if B != 1]
    groups += [[(B, 1), (B, k + 1), ("draft", B)] for B in mtp_batches]
    samples = {}
    for group in groups:
        for case, times in _interleaved(target, drafter, group, repeats, rng, log).items():
            samples.setdefault(case, []).append(times)
    within = lambda f: median([f(r) for r in range(repeats)])  # noqa: E731
    return figure(
        seconds={f"{a}x{b}": median([t for times in v for t in times]) for (a, b), v in samples.items()}, k=k,
        rows_over_one={B: within(lambda r: B * samples[(1, 1)][i][r] / samples[(B, 1)][0][r])
                       for i, B in enumerate(b for b in batches if b != 1)},
        round_in_plain_steps={B: within(lambda r: (samples[(B, k + 1)][0][r] + k * samples[("draft", B)][0][r])
                                        / samples[(B, 1)][-1][r]) for B in mtp_batches})


def _interleaved(target, drafter, cases: list, repeats: int, rng, log) -> dict:
    """Seconds of each case per repeat: (B, T) a forward of T random tokens per row over a few
    cached ones, ("draft", B) one draft step; caches dropped afterwards."""
    caches, hidden = {}, {}
    for B in {case[1] if case[0] == "draft" else case[0] for case in cases}:
        caches[B] = target.make_cache(B, max_rollback=MAX_ROLLBACK)
        out = target(mx.array(rng.integers(4, target.vocab_size, (B, 4))), caches[B])
        hidden[B] = out.hidden[:, -1]
        mx.eval(out.logits, hidden[B])

    def run(case):
        if case[0] == "draft":
            B = case[1]
            tokens = target.embed(mx.array(rng.integers(4, target.vocab_size, (B, 1))))[:, 0]
            position = mx.array(caches[B].offsets(), dtype=mx.int32)
            out = drafter.draft_step(tokens, hidden[B], target.shared_kv(caches[B]), position)
            mx.eval(out.argmax(), out.hidden)
        else:
            B, T = case
            mx.eval(target(mx.array(rng.integers(4, target.vocab_size, (B, T))), caches[B]).logits)
            caches[B].trim(T)

    times = {case: [] for case in cases}
    for r in range(repeats):
        for case in cases:
            start = time.perf_counter()
            run(case)
            times[case].append(time.perf_counter() - start)
        log(f"  steps {r + 1}/{repeats}: " + ", ".join(f"{a}x{b} {v[-1]:.1f} s" for (a, b), v in times.items())
            + f" (load {os.getloadavg()[0]:.2f})")
    return times


def measure_context(target, context: int, log, chunk: int = 4096) -> dict:
    """A one-row cache filled to `context` positions with random K/V (no forwards), then one
    decode step over it: K/V bytes per token and the sliding rings' fixed bytes."""
    cfg = target.config
    dtype = target.embed(mx.array([[1]])).dtype
    cache = target.make_cache(1, max_rollback=MAX_ROLLBACK)
    rss = rss_gib()
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        step = cache.begin(n)
        for i in range(len(cache.layer_types)):
            shape = (1, cfg.layer_kv_heads(i), n, cfg.layer_head_dim(i))
            step.store(i, mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
        mx.eval(cache.keys, cache.values)
    full = [i for i, t in enumerate(cache.layer_types) if t == FULL]
    per_token = sum(2 * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) * dtype.size for i in full)
    ring_bytes = cache.nbytes - sum(cache.keys[i].nbytes + cache.values[i].nbytes for i in full)
    step_s = time_fn(lambda: (mx.eval(target(mx.array([[5]]), cache).logits), cache.trim(1)), 1)
    res = figure(context=context, cache_gib=cache.nbytes / 2**30, full_bytes_per_token=per_token,
                 full_layers=len(full), sliding_layers=len(cache.layer_types) - len(full),
                 ring_slots=cache.tracks["sliding_attention"].capacity, ring_gib=ring_bytes / 2**30,
                 rss_growth_gib=rss_gib() - rss, decode_step_s=step_s, dtype=str(dtype).replace("mlx.core.", ""))
    log(f"context {context}: K/V cache {res['cache_gib']:.2f} GiB ({per_token / 1024:.1f} KiB/token in {len(full)} "
        f"full layers, rings {res['ring_gib']:.3f} GiB), decode step {step_s:.1f} s ({_at(res)})")
    return res


def measure_heads(drafter, batches: list, repeats: int, log) -> dict:
    """The assistant's centroid (sparse) head against the full tied head, per draft step."""
    if "masked_embedding" not in drafter:
        return {}
    embed, out = drafter.model.embed_tokens, {}
    for B in batches:
        h = mx.random.normal((B, drafter.config.text.hidden_size)).astype(drafter.model.norm.weight.dtype)
        mx.eval(h)
        sparse = time_fn(lambda: mx.eval(*drafter.masked_embedding(h, embed)), repeats)
        full = time_fn(lambda: mx.eval(mx.argmax(embed.as_linear(h), axis=-1)), repeats)
        out[B] = figure(sparse_ms=1e3 * sparse, full_ms=1e3 * full, ratio=full / sparse)
        log(f"assistant head B={B}: sparse {1e3 * sparse:.1f} ms, full {1e3 * full:.1f} ms "
            f"({full / sparse:.1f}x, {_at(out[B])})")
    return out


def watch_rss(limit_gib: float) -> None:
    """Abort the process (exit status 3) once its RSS passes `limit_gib`: a shared machine."""
    def watch():
        while rss_gib() < limit_gib:
            time.sleep(1.0)
        print(f"realsize: RSS {rss_gib():.1f} GiB passed --max-rss-gb {limit_gib}; aborting", flush=True)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x]


def run_realsize(args, log=print) -> dict:
    with using_streams(getattr(args, "streams", None)):
        return _run(args, log)


def _run(args, log) -> dict:
    if args.shape not in SHAPES:
        raise SystemExit(f"unknown shape {args.shape!r}: {', '.join(SHAPES)}")
    root = Path(args.cache_dir).expanduser()
    if args.max_rss_gb:
        watch_rss(args.max_rss_gb)
    info = checkpoint(args.shape, args.bits, root, log)
    mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    loaded, load_res = measure_load(Path(info["dir"]), log)
    target, drafter = loaded.target, loaded.drafter
    rng = np.random.default_rng(args.seed)
    reset_peak_rss()
    res = dict(mode="realsize", device=str(mx.default_device()), shape=args.shape, bits=args.bits, checkpoint=info, load=load_res,
               cache_limit_gb=args.cache_limit_gb, streams=cpu_stream_count(), k=args.k, p=args.p,
               layers=target.config.num_hidden_layers, experts=target.config.num_experts, top_k=target.config.top_k_experts, vocab=target.vocab_size)
    mx.eval(target(mx.array([[5, 6, 7, 8]])).logits)  # warm-up (compiled helpers, the CPU probe)
    res["prefill"] = measure_prefill(target, _ints(args.prefill), rng, log)
    batches = sorted(set(_ints(args.batch)) | set(_ints(args.mtp_batch)))
    prompts = [rng.integers(4, target.vocab_size, args.context).tolist() for _ in range(max(batches, default=0))]
    tokens = {B: args.tokens if B == 1 else args.batch_tokens for B in batches}
    res["plain"] = measure_plain(target, prompts, batches, tokens, log)
    res["mtp"] = measure_mtp(target, drafter, prompts, res["plain"], args.k, args.p, _ints(args.mtp_batch), log)
    res["steps"] = measure_steps(target, drafter, _ints(args.batch), _ints(args.mtp_batch), args.k, args.repeats,
                                 rng, log)
    res["heads"] = measure_heads(drafter, _ints(args.batch), args.repeats, log)
    if args.long_context:
        res["long_context"] = measure_context(target, args.long_context, log)
    res["dequantize_rows"] = dequantize_rows()
    for B, run in res["plain"].items():
        run.pop("tokens")
    res["mismatches"] = [f"MTP B={B} differs from plain from token {r['first_divergence']}"
                         for B, r in res["mtp"].items() if not r["equals_plain"]]
    return res


# Issue 22's targets on the 2-core, 24 GiB build box, for 26B-A4B at 4 bits.
TARGETS_26B = dict(load_s=60.0, peak_gib=16.0, prefill_40_s=60.0, decode_b1_tok_s=0.25, b8_over_b1=2.0)


def _verdict(ok: bool, shape: str) -> str:
    return ("met" if ok else "**missed**") if shape == "26b-a4b" else "-"


def summary_rows(res: dict) -> list:
    """(figure, value, load average, issue 22's 26B-A4B target and whether it is met)."""
    shape, load, plain, mtp = res["shape"], res["load"], res["plain"], res["mtp"]
    t = TARGETS_26B
    peak = max(_peaks({k: v for k, v in res.items() if k != "load"}))
    rows = [["load (target + assistant)", f"{load['seconds']:.1f} s", load["loadavg"],
             f"<= {t['load_s']:.0f} s: {_verdict(load['seconds'] <= t['load_s'], shape)}"],
            ["RSS after load / peak while loading", f"{load['rss_gib']:.2f} / {load['peak_rss_gib']:.2f} GiB",
             load["loadavg"], ""],
            ["peak RSS after load (prefill, decode, MTP, steps" + (", long context)" if "long_context" in res else ")"),
             f"{peak:.2f} GiB", "", f"<= {t['peak_gib']:.0f} GiB: {_verdict(peak <= t['peak_gib'], shape)}"]]
    for n, r in res["prefill"].items():
        goal = f"<= {t['prefill_40_s']:.0f} s: {_verdict(r['seconds'] <= t['prefill_40_s'], shape)}" if n == 40 else ""
        rows.append([f"prefill {n} tokens", f"{r['seconds']:.1f} s ({r['tok_s']:.2f} tok/s)", r["loadavg"], goal])
    for B, r in plain.items():
        goal = (f">= {t['decode_b1_tok_s']} tok/s: {_verdict(r['tok_s'] >= t['decode_b1_tok_s'], shape)}"
                if B == 1 else "")
        rows.append([f"plain decode B={B} ({r['decoded']} tokens)", f"{r['tok_s']:.3f} tok/s ({r['step_s']:.2f} s/step, "
                     f"median; mean {r['mean_tok_s']:.3f} tok/s)",
                     r["loadavg"], goal])
    steps = res["steps"]
    for B, ratio in steps["rows_over_one"].items():
        if B == 1:
            continue
        goal = (f">= {t['b8_over_b1']:.0f}x: {_verdict(ratio >= t['b8_over_b1'], shape)}" if B == 8 else "")
        runs = plain[B]["tok_s"] / plain[1]["tok_s"] if B in plain and 1 in plain else None
        rows.append([f"B={B} aggregate / B=1 (interleaved steps; decode runs)", f"{ratio:.2f}x; {fmt(runs)}x",
                     steps["loadavg"], goal])
    for B, r in mtp.items():
        round_cost = steps["round_in_plain_steps"].get(B)
        rows += [[f"K={res['k']} round / plain step, B={B} (interleaved steps; MTP run)",
                  f"{fmt(round_cost)}; {r['round_in_plain_steps']:.2f}", steps["loadavg"], ""],
                 [f"MTP (oracle p={res['p']}, K={res['k']}) / plain, B={B}",
                  f"{r['speedup']:.2f}x ({r['tokens_per_row_round']:.2f} tokens/row/round; at the expected "
                  f"{r['expected_tokens']:.2f}: {fmt(r['expected_tokens'] / round_cost if round_cost else None)}x)",
                  r["loadavg"], ""],
                 [f"greedy MTP == plain, B={B}, {r['tokens']} tokens", "yes" if r["equals_plain"] else
                  f"**no** (from {r['first_divergence']})", "", ""]]
    return rows


def _at(fig: dict) -> str:
    return f"load {fig['loadavg']}, peak RSS {fig['peak_rss_gib']} GiB"


def _peaks(tree) -> list:
    """Every figure's peak RSS in a (nested) result."""
    if not isinstance(tree, dict):
        return []
    return [tree.get("peak_rss_gib", 0.0)] + [p for v in tree.values() for p in _peaks(v)]


def realsize_md(res: dict) -> str:
    c = res["checkpoint"]
    written = ", ".join(f"{k} written in {v['seconds']:.0f} s (peak RSS {v['peak_rss_gib']:.1f} GiB)"
                        for k, v in c["written"].items()) or "already written"
    backend = "CPU backend" if "cpu" in res["device"] else res["device"]
    parts = [f"Checkpoint {c['dir']}: target {c['target_gb']:.2f} GiB, assistant {c['assistant_gb']:.2f} GiB on disk "
             f"({written}); assistant config {c['assistant_config']}. Measured once each (real size is slow here); "
             f"the load average beside each figure is the 1-minute one when it was taken. MLX buffer cache limit "
             f"{res['cache_limit_gb']} GiB; quantized work on {res.get('streams', 1)} CPU stream(s).",
             table(["figure", "value", "load avg", "issue 22 target (26B-A4B)"], summary_rows(res))]
    unions = [(B, r) for B, r in res["plain"].items() if r["union_per_layer"]]
    if unions:
        parts += [f"Expert union per layer in plain decode ({res['experts']} experts, top-{res['top_k']}; uniform "
                  "routing would touch the 'uniform' count):",
                  table(["B", "mean", "uniform", "per layer"],
                        [[B, f"{r['union_mean']:.1f}", f"{r['uniform_union']:.1f}",
                          " ".join(f"{u:g}" for u in r["union_per_layer"])] for B, r in unions])]
    if res["heads"]:
        parts += ["Assistant head per draft step: centroid (sparse) vs the full tied head:",
                  table(["B", "sparse ms", "full ms", "full / sparse", "load avg"],
                        [[B, fmt(r["sparse_ms"], ".1f"), fmt(r["full_ms"], ".1f"), f"{r['ratio']:.1f}x", r["loadavg"]]
                         for B, r in res["heads"].items()])]
    lc = res.get("long_context")
    if lc:
        parts.append(f"Long context: {lc['context']} positions of random {lc['dtype']} K/V in a one-row cache: "
                     f"{lc['cache_gib']:.2f} GiB ({lc['full_bytes_per_token'] / 1024:.1f} KiB per token in "
                     f"{lc['full_layers']} full layers; {lc['sliding_layers']} sliding layers' rings of "
                     f"{lc['ring_slots']} slots: {lc['ring_gib']:.3f} GiB); RSS grew {lc['rss_growth_gib']:.2f} GiB; "
                     f"one decode step over it {lc['decode_step_s']:.1f} s ({_at(lc)}).")
    return section(f"Real size: {res['shape']}, {res['bits']}-bit, random weights, {backend}, regime "
                   f"{res['regime']['name']}", *parts)
