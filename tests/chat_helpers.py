"""A tiny chat checkpoint for tests: the dense fixture target plus a character-level tokenizer
with a Gemma 4 style chat template (`<|turn>role\\n...<turn|>\\n`)."""

import json
import shutil
from pathlib import Path

TINY = Path(__file__).parent / "fixtures" / "tiny" / "dense"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
TURN_END = 5  # `<turn|>`: like Gemma 4, it ends a reply as well as <eos>
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


# Like Gemma's own templates (which trim messages and drop a reply's thinking), this one
# rewrites history, more often so: every message is trimmed and lower-cased.
REWRITING_TEMPLATE = CHAT_TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | trim | lower }}")


def write_chat_tokenizer(path: Path, template: str = CHAT_TEMPLATE) -> None:
    """128 ids: the specials, newline, then printable characters from the space on."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = ["\n"] + [chr(c) for c in range(32, 32 + 128 - len(SPECIALS) - 1)]
    vocab = {**{s: i for i, s in enumerate(SPECIALS)}, **{c: i + len(SPECIALS) for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "bos_token": "<bos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": template,
    }))
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, TURN_END]
    (path / "generation_config.json").write_text(json.dumps(gen))


def make_chat_model(dest: Path, template: str = CHAT_TEMPLATE) -> Path:
    """Copy the tiny dense target to `dest` and give it the chat tokenizer."""
    shutil.copytree(TINY / "target", dest)
    write_chat_tokenizer(dest, template)
    return dest


DRAFTER = TINY / "drafter"
