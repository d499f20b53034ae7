"""A Gemma 4 pair for long prompts, to run the real Claude Code CLI (whose system prompt and tools
take ~25k tokens) against the server: random weights in the tiny dense fixture's shapes with
`--context` positions, and the demo's BPE tokenizer (4,096 tokens) with Gemma 4's control tokens
added and the released 31B chat template (tests/fixtures). Not a test; the README's "Claude Code" part says how
it is used.

    python tests/long_context_pair.py DIR --context 65536   # writes DIR/target and DIR/drafter
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "mlx_mtp" / "demo"
TEMPLATE = ROOT / "tests" / "fixtures" / "real_configs" / "google--gemma-4-31B-it" / "chat_template.jinja"
CONTROL = ["<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
           "<|think|>", "<|channel>", "<channel|>", "<|image|>", "<|audio|>", "<|video|>"]


def write_tokenizer(dest: Path) -> dict:
    """The demo tokenizer with CONTROL added after its vocabulary; returns the vocabulary."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    tok.save(str(dest / "tokenizer.json"))
    config = json.loads((DEMO / "target" / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (dest / "chat_template.jinja").write_text(TEMPLATE.read_text())
    return tok.get_vocab()


def write_pair(dest: Path, context: int, seed: int = 0) -> None:
    """The tiny dense fixture's shapes (tests/fixtures/tiny), so that a 25k-token prefill takes
    seconds on a CPU, with random weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    sys.path.insert(0, str(ROOT))
    from apps.bench.pairs import build

    (dest / "target").mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(dest / "target")
    eos = [vocab["<eos>"], vocab["<turn|>"], vocab["<|tool_response>"]]
    configs = json.loads((ROOT / "mlx_mtp" / "selftest" / "tiny_configs.json").read_text())["dense"]
    target, drafter = configs["target"], configs["drafter"]
    target.update(vocab_size=len(vocab), max_position_embeddings=context, eos_token_id=eos, bos_token_id=vocab["<bos>"],
                  pad_token_id=vocab["<pad>"])
    drafter["text_config"].update(vocab_size=len(vocab), max_position_embeddings=context)
    for name, config, s in (("target", target, seed), ("drafter", drafter, seed + 1)):
        (dest / name).mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(dest / name / "model.safetensors"), dict(tree_flatten(build(config, s).parameters())))
        (dest / name / "config.json").write_text(json.dumps(config, indent=1))
    generation = json.loads((DEMO / "target" / "generation_config.json").read_text())
    (dest / "target" / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path)
    ap.add_argument("--context", type=int, default=65536)
    args = ap.parse_args(argv)
    write_pair(args.dest, args.context)
    print(f"wrote {args.dest}/target and {args.dest}/drafter ({args.context} positions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
