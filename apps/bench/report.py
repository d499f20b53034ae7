"""Markdown tables, JSON and a PNG plot (matplotlib optional: `pip install -e '.[bench]'`)."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Optional

from .env import device_line


def fmt(x, spec=".2f", none="-"):
    if x is None:
        return none
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def section(title: str, *parts) -> str:
    """One mode's report in the shape every mode shares: `## title`, then its parts, each followed by
    a blank line: a paragraph or a table (str), or (subheading, *parts) for a `### subheading` block.
    `render` inserts the command, regime and load lines after the heading, so the heading comes first."""
    out = [f"## {title}", ""]
    for part in parts:
        if isinstance(part, tuple):
            out += [f"### {part[0]}", ""]
            part = part[1:]
        else:
            part = (part,)
        for text in part:
            out += [text, ""]
    return "\n".join(out)


def checked(mismatches: list, clean: str) -> str:
    """The output check of an exact mode: its mismatches in bold, or `clean`, the sentence saying what
    was compared and that every output matched."""
    if mismatches:
        return "\n".join(["**OUTPUT MISMATCHES:**", *[f"- **{m}**" for m in mismatches]])
    return clean


def pivot(values: dict, ks, batches, title: str) -> str:
    rows = []
    for k in ks:
        rows.append([f"K={k}"] + [fmt(values.get(f"{k}@{b}"), ".2f") + ("x" if values.get(f"{k}@{b}") else "")
                                  for b in batches])
    return table([title] + [f"B={b}" for b in batches], rows)


def regime_note(res: dict) -> str:
    return f"Regime: {res['regime']['label']}."


def speed_md(res: dict) -> str:
    intro = (f"Measured. {res['tokens']} new tokens per row, greedy, stop tokens ignored, warm-up excluded, "
             f"median of {res['repeats']} interleaved repeats; speed-up = decode tok/s over ours-plain at the same B "
             f"and prompt class, median of within-repeat ratios. B = 1 uses `generate_tokens`, B > 1 "
             f"`BatchGenerator` (aggregate tok/s = all rows' tokens / wall, prefill included)."
             + (f" At B = 1 each run is {res['prompts']} prompts of the class in turn (tokens and times summed)."
                if res.get("prompts", 1) > 1 else ""))
    notes = [f"- {note}" for note in res["notes"]]
    if res["mismatches"]:
        check = ["\n".join(notes), checked(res["mismatches"], "")] if notes else [checked(res["mismatches"], "")]
    else:
        check = ["\n".join(notes + ["- every ours-* output equals plain greedy decoding (checked per row, every run)"])]
    return section(f"Speed: {res['pair']} ({res['quantization']}), regime {res['regime']['name']}", intro, *check,
                   "Speed-up of ours-mtp over ours-plain (geometric mean over prompt classes):",
                   pivot(res["summary"], res["draft_lengths"], res["batches"], "draft length"),
                   speed_table(res["rows"]))


def speed_table(rows: list) -> str:
    header = ["class", "B", "mode", "decode tok/s", "speed-up", "aggregate tok/s", "prompt tok/s", "TTFT ms",
              "accept. length", "per-position acceptance", "tokens/forward", "peak MB", "same output as"]
    cells = []
    for r in rows:
        same = ("yes" if r["same_output"] else f"**no** (from token {r['first_divergence']})") + f" ({r['same_as']})"
        cells.append([r["prompt_class"], r["batch"], r["mode"], fmt(r["decode_tps"], ".1f"),
                      fmt(r["speedup_vs_ours_plain"]) + "x", fmt(r["aggregate_tps"], ".1f"),
                      fmt(r["prompt_tps"], ".0f"), fmt(r["ttft_ms"], ".1f"), fmt(r["acceptance_length"]),
                      " ".join(f"{a:.2f}" for a in r["acceptance_at"]) or "-", fmt(r["tokens_per_forward"]),
                      fmt(r["peak_mb"], ".1f"), same])
    return table(header, cells)


def header(res: dict) -> list[str]:
    """The command, the regime and the machine's load around the run."""
    out = []
    if res.get("command"):
        out += [f"`{res['command']}`", ""]
    if res.get("regime"):
        out += [regime_note(res), ""]
    load = res.get("loadavg")
    if load:
        out += [f"Load average (1/5/15 min) of this {os.cpu_count()}-core machine: "
                f"{' / '.join(f'{x:.2f}' for x in load['start'])} at the start, "
                f"{' / '.join(f'{x:.2f}' for x in load['end'])} at the end.", ""]
    return out


def render(results: list[dict], info: dict) -> str:
    parts = ["# mlx_mtp benchmark", "", device_line(info), ""]
    for res in results:
        if res["mode"] == "speed":
            render_one = speed_md
        else:  # each mode's module renders it: apps.bench.<mode>.<mode>_md
            render_one = getattr(importlib.import_module(f"apps.bench.{res['mode']}"), f"{res['mode']}_md")
        body = render_one(res).split("\n")
        parts += body[:2] + header(res) + body[2:]  # after the mode's heading
    return "\n".join(parts)


def plot(results: list[dict], path: Path) -> Optional[str]:
    """speed-up vs batch size and vs draft length (speed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install -e '.[bench]'): no plot.png"
    panels = []
    for res in results:
        if res["mode"] == "speed":
            panels.append((f"measured: {res['pair']}", res["summary"], res["draft_lengths"], res["batches"]))
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for (title, values, ks, batches), (ax1, ax2) in zip(panels, axes):
        for k in ks:
            ys = [values.get(f"{k}@{b}") for b in batches]
            ax1.plot(batches, ys, marker="o", label=f"K={k}")
        ax1.set_xscale("log", base=2)
        ax1.set_xticks(batches, [str(b) for b in batches])
        ax1.set(xlabel="batch size B", ylabel="speed-up vs plain (same B)", title=title)
        xs = list(range(len(ks)))
        for b in batches:
            ax2.plot(xs, [values.get(f"{k}@{b}") for k in ks], marker="o", label=f"B={b}")
        ax2.set_xticks(xs, [str(k) for k in ks])
        ax2.set(xlabel="draft length K", ylabel="speed-up vs plain (same B)", title=title)
        for ax in (ax1, ax2):
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(results: list[dict], info: dict, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    note = plot(results, out / "plot.png")
    md = render(results, info)
    if note:
        md += f"\n_{note}_\n"
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps({"environment": info, "results": results}, indent=1, default=str))
    return md
