"""Demo-pair corpus and tokenizer: the CPython standard library sources, a SentencePiece BPE.

The corpus is every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (site-packages
excluded), so it is present on every Python install; it differs between Python versions,
so the version is recorded (the shipped pair was made with CPython 3.11.7). Files are split
deterministically by the md5 of their path relative to the stdlib: ``md5 % 50 == 0`` is
held out (never seen by the tokenizer, the target or the drafter).

Besides raw files, the training stream holds a few chat-formatted examples built from the
stdlib's own documented functions::

    <|turn>user\\nWrite a Python function `name`: <first docstring line><turn|>\\n<|turn>model\\n<source><turn|>\\n

so that the target learns the Gemma 4 turn markers and ends a reply with ``<turn|>``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import random
import sysconfig
import time
from pathlib import Path

import numpy as np

PAD, EOS, BOS, UNK = 0, 1, 2, 3
TURN_OPEN, TURN_CLOSE = "<|turn>", "<turn|>"
# user-defined pieces right after the four specials: ids 4, 5, 6
USER_SYMBOLS = [TURN_OPEN, TURN_CLOSE, "\n"]
# No whitespace-run symbols: sentencepiece escapes spaces to "▁" before matching user symbols,
# so "    " would be dead in spm yet matched by the HF tokenizer (the two would disagree).
# BPE learns "▁▁▁▁"-style indentation pieces by itself (allow_whitespace_only_pieces).
HELD_OUT_MOD = 50


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel: str) -> bool:
    """The deterministic split: md5 of the stdlib-relative path, 1 file in 50 held out."""
    return int(hashlib.md5(rel.encode()).hexdigest(), 16) % HELD_OUT_MOD == 0


def is_test(rel: str) -> bool:
    """A stdlib-relative path of test code: under a test/tests/idle_test directory, or a test_*.py file
    (61% of CPython 3.11's stdlib source by bytes)."""
    parts = rel.split("/")
    return any(p in ("test", "tests", "idle_test") for p in parts[:-1]) or parts[-1].startswith("test_")


def stdlib_files(held_out: bool | None = None) -> dict[str, str]:
    """{relative path: source} of every readable stdlib .py, sorted; filtered by split."""
    root = stdlib_root()
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        if held_out is not None and is_held_out(rel) != held_out:
            continue
        try:
            out[rel] = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
    return out


def chat_examples(files: dict[str, str], limit: int, seed: int) -> list[str]:
    """Chat-formatted (docstring -> function) examples from top-level documented functions."""
    found = []
    for rel, src in files.items():
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError):
            continue
        lines = src.split("\n")
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno - node.lineno > 40:
                continue
            first = doc.strip().split("\n")[0].strip()
            body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            found.append(
                f"{TURN_OPEN}user\nWrite a Python function `{node.name}`: {first}{TURN_CLOSE}\n"
                f"{TURN_OPEN}model\n{body}{TURN_CLOSE}\n"
            )
    random.Random(seed).shuffle(found)
    return found[:limit]


def train_tokenizer(files: dict[str, str], out: Path, vocab: int, seed: int) -> Path:
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)  # input_sentence_size sampling/shuffle
    out.mkdir(parents=True, exist_ok=True)
    lines_file = out / "spm_train_lines.txt"
    with open(lines_file, "w", encoding="utf-8") as fh:
        for src in files.values():
            for line in src.split("\n"):
                if line.strip():
                    fh.write(line + "\n")
    spm.SentencePieceTrainer.train(
        input=str(lines_file), model_prefix=str(out / "tokenizer"), vocab_size=vocab, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
        split_digits=True, user_defined_symbols=USER_SYMBOLS,
        pad_id=PAD, eos_id=EOS, bos_id=BOS, unk_id=UNK,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        input_sentence_size=2_000_000, shuffle_input_sentence=True, seed_sentencepiece_size=1_000_000,
        num_threads=1, minloglevel=2,
    )
    lines_file.unlink()
    return out / "tokenizer.model"


# Gemma 4's turn format in miniature: <bos><|turn>user\n...<turn|>\n<|turn>model\n
# (no system/tool/thinking parts). HF renders with trim_blocks + lstrip_blocks.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|turn>{{ role }}\n{{ message['content'] | trim }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def export_hf_tokenizer(model_file: Path, out: Path) -> None:
    """tokenizer.model + tokenizer.json (GemmaTokenizer, converted from the spm model) +
    tokenizer_config.json with a small Gemma-4-style chat template, in `out`."""
    import shutil
    from types import SimpleNamespace

    import sentencepiece as spm
    import transformers.convert_slow_tokenizer as conv
    from transformers import GemmaTokenizer

    class Extractor(conv.GemmaSentencePieceExtractor):
        # transformers 5.23: GemmaSentencePieceExtractor.extract reads self.sp, which no
        # constructor sets (AttributeError: 'GemmaSentencePieceExtractor' object has no attribute 'sp').
        def __init__(self, model):
            super().__init__(model)
            self.sp = spm.SentencePieceProcessor(model_file=model)

    class Converter(conv.GemmaConverter):
        SpmExtractor = Extractor

    names = SimpleNamespace(vocab_file=str(model_file), pad_token="<pad>", eos_token="<eos>",
                            bos_token="<bos>", unk_token="<unk>")
    backend = Converter(names).converted()
    tok = GemmaTokenizer(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                         unk_token="<unk>", add_bos_token=False, add_eos_token=False)
    tok.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("mask_token", None)
    cfg.update({"eot_token": TURN_CLOSE, "sot_token": TURN_OPEN, "chat_template": CHAT_TEMPLATE,
                "padding_side": "left"})
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    shutil.copyfile(model_file, out / "tokenizer.model")
    # the HF tokenizer must tokenize exactly like sentencepiece
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    for rel, src in list(stdlib_files(held_out=True).items()):
        assert tok.encode(src, add_special_tokens=False) == sp.encode(src), f"HF != spm on {rel}"


def make_data(work: Path, vocab: int = 4096, seed: int = 0, chat_examples_n: int = 2000,
              library_only: bool = False) -> dict:
    """Corpus + tokenizer + token streams under `work`: tokenizer.model, train.npy, val.npy.
    `library_only`: the streams (and chat examples) leave test code out (`is_test`); the tokenizer is
    trained on every file as before, so it is the same tokenizer."""
    t0 = time.time()
    work.mkdir(parents=True, exist_ok=True)
    train = stdlib_files(held_out=False)
    val = stdlib_files(held_out=True)
    model_file = train_tokenizer(train, work, vocab, seed)
    if library_only:
        train = {rel: src for rel, src in train.items() if not is_test(rel)}
        val = {rel: src for rel, src in val.items() if not is_test(rel)}
    t_tok = time.time() - t0
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    for rel, src in list(val.items())[:5]:
        assert sp.decode(sp.encode(src)) == src, f"round trip failed on {rel}"
    export_hf_tokenizer(model_file, work / "hf_tokenizer")
    chats = chat_examples(train, chat_examples_n, seed)
    # One document per file (and per chat example), each <bos> ... <eos>, in a seeded order.
    docs = list(train.values()) + chats
    random.Random(seed).shuffle(docs)
    streams = {"train": docs, "val": list(val.values())}
    info = {
        "python": platform.python_version(),
        "stdlib": str(stdlib_root()),
        "files": {"train": len(train), "val": len(val)},
        "held_out_rule": f"md5(relative path) % {HELD_OUT_MOD} == 0",
        "library_only": library_only,
        "chat_examples": len(chats),
        "vocab": sp.get_piece_size(),
        "tokenizer_seconds": round(t_tok, 1),
    }
    for split, texts in streams.items():
        ids = []
        for text in texts:
            ids += [BOS] + sp.encode(text) + [EOS]
        np.save(work / f"{split}.npy", np.array(ids, dtype=np.uint16))
        info[f"{split}_tokens"] = len(ids)
    info["chars_per_token"] = round(
        sum(map(len, train.values())) / max(1, info["train_tokens"]), 2)
    info["seconds"] = round(time.time() - t0, 1)
    (work / "data.json").write_text(json.dumps(info, indent=2))
    return info


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("work", type=Path)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--library-only", action="store_true",
                   help="token streams without the stdlib's test code (the same tokenizer)")
    a = p.parse_args()
    print(json.dumps(make_data(a.work, a.vocab, a.seed, library_only=a.library_only), indent=2))
