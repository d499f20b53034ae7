"""Pipeline mode: one process vs two local ranks (`mlx_mtp.distributed.pipeline`), MTP on and off.

Reports decode tok/s of each, and what crosses ranks per verify round: messages and bytes on
the device links (activations, drafts, decisions) and host control messages. LOCAL LOOPBACK
ONLY: both ranks share this machine's cores (MLX's ring backend also spins a core while it
waits), so the two-rank speed says nothing about two Macs. For two Macs, add to each round
about `hops x link latency + bytes / link bandwidth`: per round, the hidden state goes rank 0 ->
rank 1 and the decision comes back (2 hops on the critical path; the drafts travel with the
decision).

    python -m apps.bench pipeline [--pair tiny-dense|tiny-moe] [--tokens 64] [--batch 1] [--k 3]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlx_mtp.distributed import pipeline
from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.distributed.group import launched, loopback_hostfile
from mlx_mtp.loading import load

from .report import section, table
from .speed import pair_dirs

ROOT = Path(__file__).resolve().parents[2]
LATENCIES_MS = (0.05, 0.3)  # illustrative one-way link latencies: Thunderbolt, 10 GbE


def modes(k: int) -> list[tuple[str, int]]:
    return [("plain", 0), (f"mtp-{k}", k)]


def prompts(batch: int) -> list[list[int]]:
    return [[(7 * r + 3 * i) % 100 + 10 for i in range(24)] for r in range(batch)]


def measure(loaded, rows: list, tokens: int, k: int, repeats: int) -> dict:
    """Median decode tok/s of `repeats` runs after a warm-up (prefill excluded), and how many
    prompts all runs prefilled."""
    speeds, acceptance = [], []
    for run in range(repeats + 1):
        gen = BatchGenerator(loaded.target, loaded.drafter if k else None, draft_tokens=k)
        for prompt in rows:
            gen.insert(prompt, max_tokens=tokens)
        first, emitted = None, 0
        while gen.busy:
            emitted += sum(len(e.tokens) for e in gen.step())
            first = first or (time.perf_counter() if emitted else None)
        if run:
            speeds.append((emitted - len(rows)) / (time.perf_counter() - first))
            acceptance.append(gen.stats.acceptance_length)
    return dict(decode_tps=statistics.median(speeds), prefills=len(rows) * (repeats + 1),
                acceptance_length=statistics.median(acceptance) if k else 1.0)


def worker(args) -> None:
    """One of the two ranks (started by `run_pipeline_bench`)."""
    group = launched()
    target, drafter = pair_dirs(args.pair)
    loaded = pipeline.load(target, drafter, None, group)
    stage = loaded.target.pipeline
    out = {"describe": stage.describe(), "weight_bytes": stage.weight_bytes,
           "activation_bytes": loaded.target.config.hidden_size * stage.dtype.size}
    for name, k in modes(args.k):
        before = (stage.sent.messages, stage.sent.bytes, stage.sent.decisions, group.sent.messages)
        result = {}
        if group.leader:
            result = measure(loaded, prompts(args.batch), args.tokens, k, args.repeats)
            stage.done()
        else:
            stage.follow(loaded)
        out[name] = dict(result, messages=stage.sent.messages - before[0], bytes=stage.sent.bytes - before[1],
                         decisions=stage.sent.decisions - before[2], control=group.sent.messages - before[3])
    Path(args.worker, f"rank{group.rank}.json").write_text(json.dumps(out))
    group.close()


def two_ranks(args, out: Path) -> list[dict]:
    hosts = loopback_hostfile(out / "hosts.json")
    command = [sys.executable, "-m", "apps.bench.pipeline", "--worker", str(out), "--pair", args.pair,
               "--tokens", str(args.tokens), "--batch", str(args.batch), "--k", str(args.k),
               "--repeats", str(args.repeats)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_HOSTFILE": str(hosts)}
    ranks = [subprocess.Popen(command, env={**env, "MLX_RANK": str(r)}) for r in range(2)]
    if any(p.wait(timeout=1200) for p in ranks):
        raise SystemExit("a rank of the two-rank run failed")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def per_round(ranks: list[dict], name: str, prompt_tokens: int) -> dict:
    """Device traffic of one verify round, both ranks together. Every shared decision is a round
    or a prompt's first token; each prompt's prefill (its activations to rank 1, in two forwards:
    all but the last token, then the last token; its first token back) is taken off."""
    lead = ranks[0][name]
    rounds = lead["decisions"] - lead["prefills"]
    prefill_bytes = lead["prefills"] * (prompt_tokens * ranks[0]["activation_bytes"] + 4)
    prefill_messages = 3 if prompt_tokens > 1 else 2
    messages = sum(r[name]["messages"] for r in ranks) - prefill_messages * lead["prefills"]
    sent = sum(r[name]["bytes"] for r in ranks) - prefill_bytes
    return dict(rounds=rounds, messages=messages / rounds, bytes=sent / rounds,
                control=lead["control"] / rounds)


def run_pipeline_bench(args, log) -> dict:
    target, drafter = pair_dirs(args.pair)
    one = load(target, drafter)
    rows, table = prompts(args.batch), []
    with tempfile.TemporaryDirectory() as tmp:
        ranks = two_ranks(args, Path(tmp))
    for line in (ranks[0]["describe"], ranks[1]["describe"]):
        log(line)
    for name, k in modes(args.k):
        alone = measure(one, rows, args.tokens, k, args.repeats)
        split = ranks[0][name]
        traffic = per_round(ranks, name, len(rows[0]))
        tokens_per_round = args.batch * split["acceptance_length"]
        table.append(dict(mode=name, one_process_tps=alone["decode_tps"], two_ranks_tps=split["decode_tps"],
                          acceptance_length=split["acceptance_length"], messages_per_round=traffic["messages"],
                          bytes_per_round=traffic["bytes"], control_per_round=traffic["control"],
                          link_ms_per_token={str(ms): 2 * ms / tokens_per_round for ms in LATENCIES_MS}))
    return dict(mode="pipeline", pair=args.pair, batch=args.batch, tokens=args.tokens, rows=table,
                ranks=[r["describe"] for r in ranks], weight_bytes=[r["weight_bytes"] for r in ranks],
                note="local loopback only: two ranks on one machine's shared cores")


def pipeline_md(res: dict) -> str:
    what = f"{res['pair']}, B={res['batch']}, {res['tokens']} tokens"
    header = ["mode", "1 process tok/s", "2 ranks tok/s", "acceptance length", "device messages / round",
              "bytes / round", "control messages / round",
              "+ link ms / token at " + ", ".join(f"{ms} ms" for ms in LATENCIES_MS)]
    rows = [[r["mode"], f"{r['one_process_tps']:.1f}", f"{r['two_ranks_tps']:.1f}", f"{r['acceptance_length']:.2f}",
             f"{r['messages_per_round']:.2f}", f"{r['bytes_per_round']:.0f}", f"{r['control_per_round']:.2f}",
             ", ".join(f"{v:.3f}" for v in r["link_ms_per_token"].values())] for r in res["rows"]]
    return section(f"pipeline: 1 process vs 2 local ranks ({what})",
                   "LOCAL LOOPBACK ONLY (both ranks on this machine's cores, talking over 127.0.0.1).",
                   "\n".join(f"- {d}" for d in res["ranks"]), table(header, rows),
                   "Two-Mac projection: each round adds about 2 hops x link latency (rank 0 -> 1 activations, "
                   "1 -> 0 decision and drafts) plus bytes / bandwidth; per token divide by the tokens a round "
                   "emits (B x acceptance length).")


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--pair", default="tiny-dense")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    worker(ap.parse_args(argv))


if __name__ == "__main__":
    main()
