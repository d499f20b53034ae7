"""Structured mode (issue 19): JSON-schema requests on a pair, MTP on vs off.

Five schemas (a function signature, a server config, an issue, a file summary, one with long
fixed keys) and chat prompts that ask for them (`--requests` in all, schema i % 5). Every
schema bounds its strings, numbers and lists, so a reply always closes within `--max-tokens`.
Sampled at `--temperature` (0: greedy), seed = the request's index, so MTP on and off get the
same requests (their outputs agree in distribution, and token for token when greedy).

1. validity: every request runs (MTP on, batches of `--batch` rows through one BatchGenerator);
   each reply must parse as JSON and validate against its schema (`jsonschema`).
2. speed: `--speed-requests` of them one at a time (B = 1), MTP on and off interleaved per
   repeat: decode tok/s (tokens after the first / decode seconds, summed over requests); on/off
   = median of the per-repeat ratios. Also forced tokens per target forward (drafted by the
   grammar, not the drafter) and tokens per target forward.
3. host time per round added by the grammar: the host work of the rows' grammars in a round
   (forced tokens when it is built, the masks of its positions, advancing by its tokens: the
   grammar module's own timer, `Matcher.clock`) plus building the masks' array (wrapping
   `Processors.masks`: a bench-only view), per round, median and p90, at B = 1 (the speed
   runs) and at B = `--batch` (the validity run).
"""

from __future__ import annotations

import json

import numpy as np

from mlx_mtp.formats import chat as chat_format
from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.decode.grammar import Clock, Grammar, Vocabulary
from mlx_mtp.loading import load
from mlx_mtp.decode.processors import Processors
from mlx_mtp.decode.sample import SamplingParams

from .env import median
from .report import fmt, section, table
from .speed import pair_dirs

IDENT = {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,15}$"}
TYPES = {"enum": ["int", "str", "float", "bool", "list", "dict", "None"]}
SCHEMAS = [
    ("function", {"type": "object", "additionalProperties": False, "required": ["name", "args", "returns", "pure"],
                  "properties": {"name": IDENT, "returns": TYPES, "pure": {"type": "boolean"},
                                 "args": {"type": "array", "maxItems": 4, "items": {
                                     "type": "object", "additionalProperties": False, "required": ["name", "type"],
                                     "properties": {"name": IDENT, "type": TYPES}}}}}),
    ("config", {"type": "object", "additionalProperties": False,
                "required": ["host", "port", "debug", "workers", "log_level"],
                "properties": {"host": {"type": "string", "maxLength": 20},
                               "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                               "debug": {"type": "boolean"}, "workers": {"type": "integer", "minimum": 1, "maximum": 64},
                               "log_level": {"enum": ["debug", "info", "warning", "error"]}}}),
    ("issue", {"type": "object", "additionalProperties": False, "required": ["title", "labels", "priority", "assignee"],
               "properties": {"title": {"type": "string", "maxLength": 40},
                              "labels": {"type": "array", "maxItems": 3, "items": {"enum": ["bug", "docs", "perf",
                                                                                           "tests"]}},
                              "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                              "assignee": {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]}}}),
    ("file", {"type": "object", "additionalProperties": False,
              "required": ["path", "language", "lines", "imports", "has_tests"],
              "properties": {"path": {"type": "string", "maxLength": 40}, "language": {"const": "python"},
                             "lines": {"type": "integer", "minimum": 0, "maximum": 99999},
                             "imports": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 20}},
                             "has_tests": {"type": "boolean"}}}),
    ("long keys", {"type": "object", "additionalProperties": False,
                   "required": ["module_documentation_summary", "number_of_public_functions",
                                "contains_deprecated_interfaces", "recommended_replacement_module"],
                   "properties": {"module_documentation_summary": {"type": "string", "maxLength": 30},
                                  "number_of_public_functions": {"type": "integer", "minimum": 0, "maximum": 999},
                                  "contains_deprecated_interfaces": {"type": "boolean"},
                                  "recommended_replacement_module": {"type": "string", "maxLength": 20}}}),
]
MODULES = ["os.path", "json", "csv", "shutil", "argparse", "logging", "pathlib", "re", "textwrap", "heapq",
           "bisect", "functools", "itertools", "collections", "statistics", "fractions", "zipfile", "tarfile",
           "sqlite3", "unittest", "difflib", "pprint", "string", "calendar", "glob", "tempfile", "hashlib",
           "base64", "configparser", "urllib.parse", "http.server", "socketserver", "threading", "queue",
           "subprocess", "random", "decimal", "datetime", "enum", "dataclasses"]
ASKS = {"function": "Describe the main function of the Python module `{m}` as JSON: name, args, return type.",
        "config": "Write a JSON server configuration for a service built on `{m}`.",
        "issue": "File a JSON issue about a problem you might hit with the module `{m}`.",
        "file": "Summarise the source file of the Python module `{m}` as JSON.",
        "long keys": "Document the Python module `{m}` as JSON with the fields asked for."}


def requests(tokenizer, n: int) -> list[tuple[int, list, dict]]:
    """(index, prompt tokens, schema) of request i: schema i % 5, module i // 5."""
    out = []
    for i in range(n):
        name, schema = SCHEMAS[i % len(SCHEMAS)]
        ask = ASKS[name].format(m=MODULES[(i // len(SCHEMAS)) % len(MODULES)])
        ask += " The JSON schema: " + json.dumps(schema)
        out.append((i, chat_format.render(tokenizer, [{"role": "user", "content": ask}]).tokens, schema))
    return out


class GrammarClock:
    """The host time the rows' grammars take, per round: `Matcher.clock`s plus the array around
    the masks (a bench-only wrapper of `Processors.masks`)."""

    def __init__(self):
        self.extra = Clock()
        self._masks = Processors.masks

        def masks(processors, drafts, k):
            before = self.total([g for _, g in processors.grammars], own=False)
            with self.extra:
                bits = self._masks(processors, drafts, k)
            after = self.total([g for _, g in processors.grammars], own=False)
            self.extra.wall -= after[0] - before[0]  # the matchers' share is on their own clocks
            self.extra.cpu -= after[1] - before[1]
            return bits

        Processors.masks = masks

    def close(self):
        Processors.masks = self._masks

    def total(self, matchers, own: bool = True) -> tuple[float, float]:
        """(wall, CPU) seconds so far: the matchers' clocks, plus (`own`) the masks' array."""
        clocks = [m.clock for m in matchers] + ([self.extra] if own else [])
        return sum(c.wall for c in clocks), sum(c.cpu for c in clocks)


def run(loaded, vocab, batch: list, drafter: bool, max_tokens: int, sampling, B: int, clock: GrammarClock) -> dict:
    """Run `batch` (index, prompt, schema) B rows at a time; replies, stats and per-round grammar host times."""
    gen = BatchGenerator(loaded.target, loaded.drafter if drafter else None, draft_tokens="auto")
    pending, replies, per_round = list(batch), {}, []
    matchers, uids = {}, {}
    while pending or gen.busy:
        while pending and len(uids) < B:
            i, prompt, schema = pending.pop(0)
            if schema is not None:
                matchers[i] = vocab.matcher(Grammar.json(schema))
            uid = gen.insert(prompt, max_tokens=max_tokens, sampling=sampling, seed=i, stop_ids=loaded.eos_ids,
                             grammar=matchers.get(i))
            uids[uid] = i
            replies[i] = []
        before = clock.total(matchers.values())
        events = gen.step()
        after = clock.total(matchers.values())
        per_round.append((after[0] - before[0], after[1] - before[1]))
        for e in events:
            replies[uids[e.uid]] += e.tokens
            if e.finish_reason:
                del uids[e.uid]
    # Decode speed counts the tokens of rounds: each request's first token comes from its prefill.
    stats = gen.stats
    tps = (stats.emitted - len(batch)) / stats.decode_seconds if stats.decode_seconds else 0.0
    rounds = [(w, c) for w, c in per_round if w > 0]  # steps with a grammar's work (not those with none)
    return {"replies": replies, "stats": stats, "tps": tps, "grammar_ms": [1000 * w for w, _ in rounds],
            "grammar_cpu_ms": [1000 * c for _, c in rounds]}


def validate(tokenizer, replies: dict, schemas: dict, eos) -> list[str]:
    import jsonschema

    bad = []
    for i, tokens in replies.items():
        text = tokenizer.decode([t for t in tokens if t not in eos])
        try:
            jsonschema.validate(json.loads(text), schemas[i])
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append(f"request {i}: {type(e).__name__}: {str(e)[:80]} in {text[:80]!r}")
    return bad


def run_structured(args, log) -> dict:
    import mlx.core as mx

    model, drafter = pair_dirs(args.pair)
    loaded = load(model, drafter, dtype=mx.float32 if args.dtype == "float32" else None)
    vocab = Vocabulary(loaded.tokenizer, loaded.target.vocab_size, loaded.eos_ids)
    reqs = requests(loaded.tokenizer, args.requests)
    schemas = {i: s for i, _, s in reqs}
    sampling = SamplingParams(temperature=args.temperature)
    clock = GrammarClock()
    try:
        log(f"validity: {len(reqs)} requests, MTP on, B={args.batch}")
        whole = run(loaded, vocab, reqs, True, args.max_tokens, sampling, args.batch, clock)
        bad = validate(loaded.tokenizer, whole["replies"], schemas, loaded.eos_ids)
        speed_reqs = reqs[: args.speed_requests]
        plain_reqs = [(i, p, None) for i, p, _ in speed_reqs]
        runs = {"on": [], "off": [], "unconstrained": []}
        run(loaded, vocab, speed_reqs[:2], True, args.max_tokens, sampling, 1, clock)  # warm-up
        for r in range(args.repeats):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                log(f"speed: repeat {r}, MTP {mode}")
                runs[mode].append(run(loaded, vocab, speed_reqs, mode == "on", args.max_tokens, sampling, 1, clock))
            runs["unconstrained"].append(run(loaded, vocab, plain_reqs, True, args.max_tokens, sampling, 1, clock))
    finally:
        clock.close()
    return summarize(args, whole, bad, runs)


def summarize(args, whole: dict, invalid: list, runs: dict) -> dict:
    bad = list(invalid)
    ratios = [on["tps"] / off["tps"] for on, off in zip(runs["on"], runs["off"])]
    if args.temperature == 0:  # greedy: MTP on gives plain decoding's tokens
        bad = bad + [f"request {i}: MTP on differs from MTP off" for on, off in zip(runs["on"], runs["off"])
                     for i in on["replies"] if on["replies"][i] != off["replies"][i]]
    rows = []
    for mode in ("on", "off", "unconstrained"):
        stats = [res["stats"] for res in runs[mode]]
        rows.append({
            "mode": {"on": "JSON schema, MTP on", "off": "JSON schema, MTP off",
                     "unconstrained": "no grammar, MTP on"}[mode],
            "decode_tps": median([res["tps"] for res in runs[mode]]),
            "tokens_per_forward": median([s.emitted / max(s.target_forwards, 1) for s in stats]),
            "forced_per_forward": median([s.forced / max(s.target_forwards, 1) for s in stats]),
            "acceptance_length": median([s.acceptance_length for s in stats]),
            **host_times(runs[mode]),
        })
    s = whole["stats"]
    return {
        "mode": "structured", "pair": args.pair, "dtype": args.dtype, "temperature": args.temperature,
        "requests": args.requests, "valid": args.requests - len(invalid), "invalid": invalid[:10], "batch": args.batch,
        "speed_requests": args.speed_requests, "repeats": args.repeats, "max_tokens": args.max_tokens,
        "on_off": median(ratios), "on_off_each": ratios, "rows": rows,
        "batched": {"forced_per_forward": s.forced / max(s.target_forwards, 1),
                    "tokens_per_forward": s.emitted / max(s.target_forwards, 1), **host_times([whole]),
                    "tokens": s.emitted},
        "mismatches": bad,
    }


def host_times(results: list) -> dict:
    """Grammar host ms per round, wall and CPU: median and p90 over a run's rounds, then the
    median over runs (None without a grammar)."""
    out = {}
    for key in ("grammar_ms", "grammar_cpu_ms"):
        runs = [r[key] for r in results if r[key]]
        out[key] = median([median(x) for x in runs]) if runs else None
        out[key + "_p90"] = median([float(np.percentile(x, 90)) for x in runs]) if runs else None
    return out


def _host(r: dict) -> str:
    if r["grammar_ms"] is None:
        return "-"
    return (f"{r['grammar_cpu_ms']:.3f} (p90 {r['grammar_cpu_ms_p90']:.3f}) / "
            f"{r['grammar_ms']:.3f} (p90 {r['grammar_ms_p90']:.3f})")


def structured_md(res: dict) -> str:
    b = res["batched"]
    intro = (f"Measured. Five bounded schemas, chat prompts, temperature {res['temperature']}, seed = request index, "
             f"`max_tokens` {res['max_tokens']}. Validity: {res['requests']} requests, MTP on, {res['batch']} rows "
             f"at a time. Speed: {res['speed_requests']} requests one at a time, {res['repeats']} interleaved "
             "repeats, decode tok/s medians; grammar host ms = the rows' grammar work per round (forced tokens, "
             "masks, advancing; median over rounds, then over repeats): CPU time of the host thread (the work) / "
             "wall time (on this 2-core CPU the device's MLX threads compete with the host for the cores).")
    on_off = ", ".join(f"{r:.2f}" for r in res["on_off_each"])
    findings = [f"- **{res['valid']} / {res['requests']} replies validate** against their schema"
                + ("" if not res["invalid"] else ": " + "; ".join(res["invalid"])),
                f"- **MTP on / off: {res['on_off']:.2f}x** (per repeat: {on_off})",
                f"- B = {res['batch']} (validity run): grammar host ms per round, CPU / wall: {_host(b)}; "
                f"{b['forced_per_forward']:.2f} forced tokens and {b['tokens_per_forward']:.2f} tokens per target "
                f"forward over {b['tokens']} tokens"]
    header = ["B = 1", "decode tok/s", "tokens / forward", "forced / forward", "accept. length",
              "grammar host ms / round: CPU / wall (median, p90)"]
    rows = [[r["mode"], fmt(r["decode_tps"], ".1f"), fmt(r["tokens_per_forward"]), fmt(r["forced_per_forward"]),
             fmt(r["acceptance_length"]), _host(r)] for r in res["rows"]]
    return section(f"Structured output: {res['pair']} ({res['dtype']}), JSON-schema requests", intro,
                   "\n".join(findings), table(header, rows))
