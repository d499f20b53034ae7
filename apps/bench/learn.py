"""`python -m apps.bench learn`: the demo drafter adapted to traffic of a kind it never saw (issues 37, 43).

0. Target: `--traffic c` (the default): the shipped demo target, prompted with excerpts of C (this Python's
   C API headers; the pair was trained on Python only). `--traffic tool-calls`: JSON tool-call transcripts,
   for which `--tune-steps` (default 40 there) first fine-tunes the target, half of each batch stdlib code as
   before, so that it answers them in kind as a real target does (the shipped one answers every prompt with
   stdlib-style code); the drafter stays the stock one.
1. Traffic: `--requests` prompts answered by that target through an `Engine` that keeps them (`learn_dir`),
   MTP on, sampled at `--temperature` (0.8: greedy replies of the shipped target fall at once into a repeat,
   "1, 1, 1, ..."). Served once: `--captures DIR` keeps them, and a rerun serves only what is missing.
2. Adaptation: `mlx_mtp.learn.learner.adapt` on it within `--minutes`, measuring included (as `python -m
   mlx_mtp.learn --minutes`): accepted drafts per round (K = 3) before and after, on the newest tenth of the
   requests (held out; the sample that fits a quarter of the time) and on the general sample (standard
   library modules), the noise margin, whether the adapted drafter was written, and where the time went.
3. Wall clock (`--wall-prompts`, 0: skipped): the held-out prompts again, one at a time (B = 1), greedy,
   plain and MTP `auto` with the drafter before and after; tok/s and whether MTP's tokens equal plain's.

`--real-step 31b,26b-a4b` instead times one distillation step of the released assistants at their real
size (random weights and target features): the plan for adapting them on a Mac in `apps/README.md`.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

TRAFFIC = {"c": "excerpts of C headers", "tool-calls": "tool-call transcripts"}
TOOLS = {"get_weather": ("city", "unit"), "search_files": ("pattern", "path"), "send_email": ("to", "subject"),
         "create_event": ("title", "date"), "run_query": ("sql", "database"), "translate": ("text", "language")}
VALUES = ["Paris", "celsius", "*.py", "/home/ana/src", "bob@example.com", "Quarterly report", "Team sync",
          "2026-12-01", "SELECT name FROM users", "analytics", "good morning", "German", "Tokyo", "fahrenheit"]


def tool_call_transcripts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, reply): JSON transcripts of tool-calling conversations, cut where the assistant's next
    message begins, and that message: another call, or a summary that copies the last tool's result."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "user", "content": f"Please {rng.choice(['check', 'find', 'do'])} this for me."}]
        for _ in range(rng.integers(1, 3)):
            name, arguments = call(rng)
            result = {"ok": bool(rng.integers(2)), "value": int(rng.integers(100))}
            messages.append({"role": "assistant", "tool_calls": [{"name": name, "arguments": arguments}]})
            messages.append({"role": "tool", "name": name, "content": json.dumps(result)})
        if rng.integers(2):
            reply = {"content": f"{name} returned {result['value']} ({'ok' if result['ok'] else 'failed'})."}
        else:
            reply = dict(zip(("name", "arguments"), call(rng)))
            reply = {"tool_calls": [reply]}
        prompt = json.dumps(messages, indent=1)[:-2] + ",\n {\"role\": \"assistant\", "
        out.append((prompt, json.dumps(reply)[1:] + "\n]"))
    return out


def call(rng) -> tuple[str, dict]:
    name = str(rng.choice(list(TOOLS)))
    return name, {key: str(rng.choice(VALUES)) for key in TOOLS[name]}


def tool_call_prompts(n: int, seed: int = 0) -> list[str]:
    return [prompt for prompt, _ in tool_call_transcripts(n, seed)]


def c_headers(chars: int = 1000) -> list[str]:
    """This Python's own C API headers (`sysconfig`'s include directory: C that any Python install has and
    the demo pair never saw) longer than 2 * `chars`."""
    import sysconfig

    headers = sorted(Path(sysconfig.get_paths()["include"]).rglob("*.h"))
    texts = [t for t in (h.read_text(encoding="utf-8", errors="replace") for h in headers) if len(t) > 2 * chars]
    if not texts:
        raise FileNotFoundError(f"no C headers under {sysconfig.get_paths()['include']} (install Python's headers)")
    return texts


def c_header_prompts(n: int, seed: int = 0, chars: int = 1000) -> list[str]:
    """`n` excerpts of C code (`c_headers`), each about `chars` long and cut at a line's end."""
    texts = c_headers(chars)
    rng, out = np.random.default_rng(seed), []
    for _ in range(n):
        text = texts[int(rng.integers(len(texts)))]
        start = text.find("\n", int(rng.integers(0, len(text) - chars))) + 1
        end = text.rfind("\n", start, start + chars) + 1
        out.append(text[start : end if end > start else start + chars])
    return out


def tuned_target(folder: Path, steps: int, log, traffic: str = "tool-calls") -> Path:
    """The demo target fine-tuned for `steps` on the `traffic`'s kind of text (tool-call transcripts, or the
    C headers the C prompts are excerpts of), half of each batch stdlib code as before (kept in
    `folder`/target and reused): a target that answers such prompts in kind, as a real one does, while its
    drafter only ever saw stdlib code. Next-token loss, AdamW at 3e-4, fp32."""
    import shutil

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_mtp.learn import distill, learner as learn
    from mlx_mtp.demo import TARGET_DIR, load_demo
    from mlx_mtp.loading import load_model
    from mlx_mtp.models.layout import checkpoint_weights

    out = folder / "target"
    if (out / "model.safetensors").exists():
        return out
    tokenizer = load_demo(mtp=False).tokenizer
    texts = ([prompt + reply for prompt, reply in tool_call_transcripts(1000, seed=1234)] if traffic == "tool-calls"
             else c_headers())
    ids = np.concatenate([np.asarray(tokenizer.encode(t), np.int32) for t in texts])
    code = distill.load_tokens(learn.stdlib(learn.REPLAY_FILES), tokenizer)
    target = load_model(TARGET_DIR, dtype=mx.float32)[0]
    target.train()
    step = nn.value_and_grad(target, lambda m, x, y: nn.losses.cross_entropy(m(x).logits, y, reduction="mean"))
    opt, rng, started = optim.AdamW(3e-4), np.random.default_rng(0), time.perf_counter()
    for i in range(steps):
        rows = mx.array(np.stack([window(code if j % 2 else ids, 257, rng) for j in range(8)]))
        loss, grads = step(target, rows[:, :-1], rows[:, 1:])
        opt.update(target, optim.clip_grad_norm(grads, 1.0)[0])
        mx.eval(target.parameters(), opt.state, loss)
        if (i + 1) % 10 == 0 or i + 1 == steps:
            log(f"  tuning the target on {TRAFFIC[traffic]}: step {i + 1}/{steps}, loss {loss.item():.3f} "
                f"({time.perf_counter() - started:.0f} s)")
    temp = folder / "target.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    shutil.copytree(TARGET_DIR, temp, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    mx.save_safetensors(str(temp / "model.safetensors"), checkpoint_weights(target))
    temp.rename(out)
    return out


def window(ids: np.ndarray, size: int, rng) -> np.ndarray:
    start = int(rng.integers(0, len(ids) - size))
    return ids[start : start + size]


def capture_traffic(loaded, prompts: list[str], folder: Path, max_tokens: int, temperature: float, log) -> float:
    """Serve `prompts` through an Engine that keeps them in `folder` (seeded sampling); seconds taken."""
    import mlx_mtp

    started = time.perf_counter()
    sampling = mlx_mtp.SamplingParams(temperature=temperature)
    with mlx_mtp.Engine(loaded, max_batch=8, learn_dir=folder) as engine:
        handles = [engine.submit(mlx_mtp.Request(p, max_tokens=max_tokens, sampling=sampling, seed=i))
                   for i, p in enumerate(prompts)]
        for i, h in enumerate(handles):
            h.result()
            if (i + 1) % 200 == 0:
                log(f"  {i + 1}/{len(prompts)} requests served ({time.perf_counter() - started:.0f} s)")
    return time.perf_counter() - started


def wall_clock(loaded, drafter, prompts: list[list[int]], max_tokens: int) -> dict:
    """B = 1 tok/s of plain and MTP auto over `prompts` (token ids), and whether MTP equals plain."""
    from mlx_mtp.decode.generate import generate_tokens

    out, runs = {}, {}
    for mode in ("plain", "auto"):
        tokens, started = 0, time.perf_counter()
        runs[mode] = []
        for p in prompts:
            got = [t for t, _ in generate_tokens(loaded.target, p, drafter=drafter if mode == "auto" else None,
                                                 draft_tokens="auto" if mode == "auto" else 0, max_tokens=max_tokens)]
            runs[mode].append(got)
            tokens += len(got)
        out[mode] = tokens / (time.perf_counter() - started)
    out["equals_plain"] = runs["auto"] == runs["plain"]
    return out


def run_learn(args, log=print) -> dict:
    if args.real_step:
        return dict(mode="learn", real_step=[real_step(shape, args.real_batch, args.real_seq, train, log)
                                             for shape in args.real_step.split(",") for train in (True, False)])
    import mlx.core as mx

    from mlx_mtp.learn import capture, distill, learner as learn
    from mlx_mtp.demo import DRAFTER_DIR, TARGET_DIR
    from mlx_mtp.loading import load, load_model

    folder = Path(args.captures or tempfile.mkdtemp(prefix="mlx_mtp-learn-"))
    folder.mkdir(parents=True, exist_ok=True)
    tune = args.tune_steps if args.tune_steps is not None else (40 if args.traffic == "tool-calls" else 0)
    target_dir = tuned_target(folder, tune, log, args.traffic) if tune else TARGET_DIR
    loaded = load(target_dir, DRAFTER_DIR, dtype=mx.float32)
    res = dict(mode="learn", requests=args.requests, max_tokens=args.max_tokens, captures=str(folder),
               temperature=args.temperature, tune_steps=tune, traffic=args.traffic)
    kept = folder / "captured"
    have = len(list(capture.read(kept)))
    if have < args.requests:  # served once: a rerun on --captures reuses them
        prompts = (tool_call_prompts if args.traffic == "tool-calls" else c_header_prompts)(args.requests, args.seed)
        log(f"serving {args.requests - have} {TRAFFIC[args.traffic]} through the demo pair, kept in {kept}")
        res["serve_s"] = capture_traffic(loaded, prompts[have:], kept, args.max_tokens, args.temperature, log)
    if args.serve_only:
        return res
    records = sorted(capture.read(kept), key=lambda r: r.time)[-args.requests :]
    res["tokens"] = int(sum(len(r.prompt) + len(r.reply) for r in records))
    res["served_acceptance"] = sum(r.accepted for r in records) / max(1, sum(r.rounds for r in records))
    started = time.perf_counter()  # --minutes bounds the adaptation from here, as `mlx_mtp.learn`'s whole run
    tokenizer = loaded.tokenizer
    replay = distill.load_tokens(learn.stdlib(learn.REPLAY_FILES), tokenizer)
    out = folder / "adapted"
    res["adapt"] = learn.adapt(loaded.target, DRAFTER_DIR, records, learn.general_sample(tokenizer, seq=args.seq),
                               out, steps=args.steps, minutes=args.minutes - (time.perf_counter() - started) / 60,
                               replay=replay, seq=args.seq, batch=args.batch, lr=args.lr, progress=log)
    held = [list(map(int, r.prompt)) for r in learn.split(records)[1]][: args.wall_prompts]
    res["wall_clock"] = {"before": wall_clock(loaded, loaded.drafter, held, args.max_tokens)} if held else {}
    if res["adapt"]["written"] and held:
        res["wall_clock"]["after"] = wall_clock(loaded, load_model(out, dtype=mx.float32)[0], held, args.max_tokens)
    for when, w in res["wall_clock"].items():
        log(f"  held-out B=1, {when}: plain {w['plain']:.1f} tok/s, auto {w['auto']:.1f} tok/s "
            f"({w['auto'] / w['plain']:.2f}x), equals plain: {w['equals_plain']}")
    res["mismatches"] = [f"MTP differs from plain ({when})" for when, w in res["wall_clock"].items()
                         if not w["equals_plain"]]
    return res


def learn_md(res: dict) -> str:
    from .report import section, table  # imports mlx: lazily, as everywhere here (the transcripts need none)

    if "real_step" in res:
        rows = [[r["shape"], f"{r['batch']} x {r['seq']}", "trained" if r["train_embedding"] else "frozen",
                 f"{r['params'] / 1e6:.0f} M / {r['trained'] / 1e6:.0f} M", f"{r['step_s']:.1f} s",
                 f"{r['peak_gib']:.2f} GiB"] for r in res["real_step"]]
        return section("Learn: one distillation step at a released assistant's size",
                       table(["assistant", "tokens", "embedding", "params / trained", "step", "peak memory"], rows))
    if "adapt" not in res:  # --serve-only
        return section(f"Learn: {res['requests']} {TRAFFIC[res['traffic']]} served into {res['captures']}",
                       f"Tuned {res['tune_steps']} steps; serving took {res.get('serve_s', 0):.0f} s.")
    a = res["adapt"]
    rows = [["held-out requests", f"{a['before']['held_out']:.3f}", f"{a['after']['held_out']:.3f}",
             f"{a['after']['held_out'] - a['before']['held_out']:+.3f} (margin {a['margin']:.3f})"],
            ["general sample (stdlib)", f"{a['before']['general']:.3f}", f"{a['after']['general']:.3f}",
             f"{a['after']['general'] - a['before']['general']:+.3f}"]]
    target = f"tuned on {TRAFFIC[res['traffic']]} for {res['tune_steps']} steps" if res["tune_steps"] else "as shipped"
    times = ", ".join(f"{name.replace('_', ' ')} {s:.0f} s" for name, s in a.get("times", {}).items())
    walls = [f"- held-out prompts at B=1, drafter {when}: plain {w['plain']:.1f} tok/s, MTP auto "
             f"{w['auto']:.1f} tok/s ({w['auto'] / w['plain']:.2f}x), equals plain: {w['equals_plain']}"
             for when, w in res["wall_clock"].items()]
    parts = [f"Target: the demo target {target}. Served at temperature {res['temperature']}: "
             f"{res['served_acceptance']:.2f} drafts accepted per MTP round while serving.",
             f"{res['tokens']} captured tokens; {a['train_requests']} requests trained on ({a['train_tokens']} "
             f"tokens with the replay), {a['held_out_requests']} held out; {a['steps']} steps in "
             f"{a['seconds']:.0f} s ({times}); written: {a['written']}.",
             table(["accepted drafts per round (K=3)", "before", "after", "change"], rows)]
    if walls:
        parts.append("\n".join(walls))
    return section(f"Learn: the demo drafter adapted to {res['requests']} served {TRAFFIC[res['traffic']]}", *parts)


def real_step(shape: str, batch: int, seq: int, train_embedding: bool, log) -> dict:
    """One distillation step of `shape`'s assistant at its released size (random weights, fp32, AdamW;
    K = 3) on target features of the released target's shapes, drawn at random (the cost does not
    depend on their values): seconds per step (median of 3 after one warm-up) and peak memory."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_mtp.learn import distill
    from mlx_mtp.cache.kv import FULL, SLIDING, SharedKV
    from mlx_mtp.models import gemma4

    from .cost import ASSISTANTS, CONFIGS, TARGETS
    from .env import median

    tc = gemma4.Config.from_dict(json.loads((CONFIGS / TARGETS[shape] / "config.json").read_text()))
    config = json.loads(ASSISTANTS[shape][0].read_text())
    config.pop("_partial", None)
    drafter = distill.new_drafter(config)
    d = distill.Distiller(None, drafter, None, steps=100, k=3, train_embedding=train_embedding)
    draw = lambda *shape: mx.random.normal(shape) * 0.1  # noqa: E731
    shared = {}
    for kind in (SLIDING, FULL):
        src = tc.store_layer(kind)
        kv = (batch, tc.layer_kv_heads(src), seq, tc.layer_head_dim(src))
        shared[kind] = SharedKV(draw(*kv), draw(*kv), mx.broadcast_to(mx.arange(seq, dtype=mx.int32), (batch, seq)))
    features = (draw(batch, seq, tc.hidden_size), draw(batch, seq, tc.hidden_size),
                mx.random.randint(0, tc.vocab_size, (batch, seq)), shared)
    mx.eval(features[:3], [(kv.keys, kv.values) for kv in shared.values()])
    mx.reset_peak_memory()
    times = []
    for i in range(4):
        started = time.perf_counter()
        d.learn(features)
        times.append(time.perf_counter() - started)
        log(f"  {shape} assistant, {batch} x {seq} tokens, embedding {'trained' if train_embedding else 'frozen'}: "
            f"step {i + 1} {times[-1]:.1f} s")
    params = sum(v.size for _, v in tree_flatten(drafter.parameters()))
    trained = sum(v.size for _, v in tree_flatten(drafter.trainable_parameters()))
    return dict(shape=shape, batch=batch, seq=seq, train_embedding=train_embedding, params=params, trained=trained,
                step_s=median(times[1:]), peak_gib=mx.get_peak_memory() / 2**30)


def demo_inputs(captures: Path, requests: int, seq: int) -> tuple:
    """What `learn` adapts the demo drafter with: (the demo target in fp32, the newest `requests` captured
    requests, the general sample, the replay)."""
    import mlx.core as mx

    from mlx_mtp.learn import capture, distill, learner as learn
    from mlx_mtp.demo import TARGET_DIR
    from mlx_mtp.loading import load_model, load_tokenizer

    target, _, path = load_model(TARGET_DIR, dtype=mx.float32)
    tokenizer = load_tokenizer(path)
    records = sorted(capture.read(Path(captures) / "captured"), key=lambda r: r.time)[-requests:]  # as `learn`
    return (target, records, learn.general_sample(tokenizer, seq=seq),
            distill.load_tokens(learn.stdlib(learn.REPLAY_FILES), tokenizer))


def compare(captures: Path, variants: list[dict], held_out: int = 40, requests: int = 800, seq: int = 128,
            batch: int = 4, log=print) -> dict:
    """Training variants of the adaptation side by side in one process: each from the stock demo drafter
    on the same batches of the newest `requests` captured requests (their windows and the replay as `learn` makes them),
    then measured on the same `held_out` held-out requests and the general sample. The target's
    features are computed once and kept for every variant. Times are CPU seconds of this process (what the
    other jobs on a shared machine change least). A variant: steps, lr, warmup, train_on (replies | all),
    embedding (trained | frozen), optimizer (adamw | sgd: momentum 0.9)."""
    import mlx.core as mx
    import mlx.optimizers as optim

    from mlx_mtp.learn import distill, learner as learn
    from mlx_mtp.demo import DRAFTER_DIR
    from mlx_mtp.loading import load_model

    target, records, general, replay = demo_inputs(captures, requests, seq)
    a = learn.Adaptation(target, DRAFTER_DIR, records, general, seq=seq, batch=batch,
                         replay=replay)  # its windows and measures, as the real run makes them
    a.held.keep(held_out)
    measures = {"held_out": a.held, "general": a.general}

    def measure(drafter) -> dict:
        drafter.eval()
        return {name: [t for i in range(len(m.batches)) for t in m.run(drafter, i)] for name, m in measures.items()}

    before, out = measure(load_model(DRAFTER_DIR, dtype=mx.float32)[0]), []
    log(f"before: held-out {learn.mean(before['held_out']):.3f}, general {learn.mean(before['general']):.3f} "
        f"(accepted drafts per round, K={learn.K}; {len(before['held_out'])} held-out requests)")
    firsts = list(a.pool.firsts)
    for v in variants:
        drafter = load_model(DRAFTER_DIR, dtype=mx.float32)[0]
        d = distill.Distiller(None, drafter, None, steps=v["steps"], k=learn.K, seq=seq, batch=batch, lr=v["lr"],
                              warmup=v.get("warmup"), train_embedding=v.get("embedding", "trained") == "trained")
        if v.get("optimizer", "adamw") == "sgd":
            d.opt = optim.SGD(learning_rate=d._rate, momentum=0.9)
        a.pool.firsts = firsts if v.get("train_on", "replies") == "replies" else [1] * len(firsts)
        spent = {"target": 0.0, "drafter": 0.0}
        for step in range(v["steps"]):
            began = time.process_time()
            features = a.pool.features(step)
            middle = time.process_time()
            drafter.train()
            d.learn(features, a.pool.start(step))
            spent["target"] += middle - began
            spent["drafter"] += time.process_time() - middle
        report = learn.verdict(before, measure(drafter))
        out.append(dict(variant=v, cpu_s={k: round(s, 1) for k, s in spent.items()}, **report))
        log(f"{v}: drafter {spent['drafter'] / v['steps']:.2f} s CPU a step (the target's features, new ones "
            f"only: {spent['target']:.0f} s); held-out {report['before']['held_out']:.3f} -> "
            f"{report['after']['held_out']:.3f} (margin {report['margin']:.3f}), general {report['before']['general']:.3f}"
            f" -> {report['after']['general']:.3f}")
    return dict(mode="learn-compare", captures=str(captures), held_out=held_out, results=out)


def ahead_speed(captures: Path, steps: int = 8, repeats: int = 2, requests: int = 800, seq: int = 128,
                batch: int = 4, log=print) -> dict:
    """Training steps of the adaptation with the next step's target features computed ahead on a thread
    of their own, and without: `steps` fresh steps each (first-epoch batches: their features not yet
    kept), the two alternating `repeats` times, wall seconds a step (median), and whether they trained
    the same (the last loss)."""
    from mlx_mtp.learn import learner as learn
    from mlx_mtp.demo import DRAFTER_DIR

    target, records, general, replay = demo_inputs(captures, requests, seq)
    seconds, losses = {False: [], True: []}, {}
    for _ in range(repeats):
        for ahead in (False, True):
            a = learn.Adaptation(target, DRAFTER_DIR, records, general, steps=steps, seq=seq, batch=batch,
                                 replay=replay, ahead=ahead)
            began = time.perf_counter()
            losses[ahead] = list(a._train())[-1]  # training alone: no measuring, no time bound
            seconds[ahead].append((time.perf_counter() - began) / steps)
            log(f"features ahead: {ahead}: {seconds[ahead][-1]:.2f} s a step (waiting for the target's features "
                f"{a.times['train_target'] / steps:.2f} s), last loss {losses[ahead]:.5f}")
    serial, ahead = (float(np.median(seconds[k])) for k in (False, True))
    log(f"median of {repeats}: {serial:.2f} -> {ahead:.2f} s a step ({serial / ahead:.2f}x), "
        f"same training: {losses[False] == losses[True]}")
    return dict(mode="learn-ahead", steps=steps, repeats=repeats, serial_s=serial, ahead_s=ahead,
                same=losses[False] == losses[True])


def parse_variant(text: str) -> dict:
    """'steps=60,lr=1e-3,train_on=all' -> a `compare` variant (steps and lr required)."""
    v = dict(part.split("=", 1) for part in text.split(",") if part)
    if "steps" not in v or "lr" not in v:
        raise ValueError(f"variant {text!r}: steps= and lr= are required")
    v["steps"], v["lr"] = int(v["steps"]), float(v["lr"])
    if "warmup" in v:
        v["warmup"] = int(v["warmup"])
    return v


def main(argv=None) -> int:
    """`python -m apps.bench.learn --captures DIR --variant SPEC [--variant SPEC ...]`: `compare`;
    `--ahead-steps N` instead: `ahead_speed`."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m apps.bench.learn", description=compare.__doc__.splitlines()[0])
    ap.add_argument("--captures", required=True, help="a `python -m apps.bench learn --captures` directory")
    ap.add_argument("--variant", action="append",
                    help="steps=N,lr=X[,warmup=N][,train_on=replies|all][,embedding=trained|frozen]"
                         "[,optimizer=adamw|sgd] (repeatable)")
    ap.add_argument("--held-out", type=int, default=40, help="held-out requests measured (default: 40)")
    ap.add_argument("--requests", type=int, default=800, help="the newest captured requests used, as `python -m "
                                                              "apps.bench learn --requests` (default: 800)")
    ap.add_argument("--ahead-steps", type=int, help="instead of variants: time this many training steps with the "
                                                     "target's features computed ahead and without (`ahead_speed`)")
    ap.add_argument("--repeats", type=int, default=2, help="with --ahead-steps: runs of each (default: 2)")
    ap.add_argument("--out", help="write the results here as JSON (default: only printed)")
    args = ap.parse_args(argv)
    if (args.variant is None) == (args.ahead_steps is None):
        ap.error("give --variant (one or more) or --ahead-steps")
    if args.ahead_steps is not None:
        res = ahead_speed(Path(args.captures), args.ahead_steps, args.repeats, args.requests)
    else:
        res = compare(Path(args.captures), [parse_variant(v) for v in args.variant], args.held_out, args.requests)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
