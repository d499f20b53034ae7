"""A tiny chat checkpoint for tests: the dense fixture target plus a character-level tokenizer
with a Gemma 4 style chat template (`<|turn>role\\n...<turn|>\\n`)."""

import json
import shutil
from typing import Optional
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
# A template that rewrites every message past recognition (its first character dropped, the rest
# trimmed and lower-cased): no reply can be spliced back in as generated (`chat_format.render_spliced`).
REWRITING_TEMPLATE = CHAT_TEMPLATE.replace("{{ m['content'] }}", "{{ (m['content'] | trim | lower)[1:] }}")


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


# ---- a tokenizer with Gemma 4's control tokens, at their real ids -------------------------------

GEMMA4_SPECIALS = {
    "<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4,
    "<|tool>": 46, "<tool|>": 47, "<|tool_call>": 48, "<tool_call|>": 49, "<|tool_response>": 50,
    "<tool_response|>": 51, '<|"|>': 52, "<|think|>": 98, "<|channel>": 100, "<channel|>": 101,
    "<|turn>": 105, "<turn|>": 106,
}
GEMMA4_EOS = [1, 106, 50]  # generation_config.json of the -it checkpoints
NEWLINE = 107


def gemma4_vocab(size: int = 128) -> dict:
    """Gemma 4's control tokens at their ids, "\\n" at 107, then tab and printable ASCII
    characters in the free ids; ids left over become unused special tokens."""
    vocab = {**GEMMA4_SPECIALS, "\n": NEWLINE}
    free = iter(i for i in range(size) if i not in vocab.values())
    for c in ["\t"] + [chr(c) for c in range(32, 127)]:
        vocab[c] = next(free)
    for i in free:
        vocab[f"<unused{i}>"] = i
    return vocab


def write_gemma4_tokenizer(path: Path, template: Optional[str] = None, vocab: Optional[dict] = None) -> None:
    """A character-level tokenizer with Gemma 4's control tokens (at their real ids), as
    `tokenizer.json` + `tokenizer_config.json` in `path`; `template` becomes `chat_template.jinja`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = vocab or gemma4_vocab()
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    specials = [t for t in vocab if t.startswith("<") and len(t) > 1]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "bos_token": "<bos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>",
    }, indent=1))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)


# ---- a tiny chat model that takes images -----------------------------------------------------------

VISION = Path(__file__).parent / "fixtures" / "vision"
IMAGE_SPECIALS = {"<|image>": 120, "<|image|>": 121, "<image|>": 122}  # the vision fixtures' ids
GEMMA4_TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "gemma4-large-2026-07-14.jinja"


def make_vision_chat_model(dest: Path, variant: str = "bidir") -> Path:
    """A copy of a vision fixture (tests/fixtures/vision/<variant>) as a chat model (`write_vision_chat_files`)."""
    shutil.copytree(VISION / variant, dest)
    return write_vision_chat_files(dest)


def write_vision_chat_files(dest: Path) -> Path:
    """The Gemma 4 tokenizer (its image tokens at the vision fixtures' ids), the released 26B/31B chat
    template and a budget of 70 soft tokens, written into the checkpoint at `dest`."""
    vocab = {t: i for t, i in gemma4_vocab().items() if i not in IMAGE_SPECIALS.values()}
    write_gemma4_tokenizer(dest, GEMMA4_TEMPLATE.read_text(), {**vocab, **IMAGE_SPECIALS})
    gen = json.loads((dest / "generation_config.json").read_text())
    gen["eos_token_id"] = GEMMA4_EOS
    (dest / "generation_config.json").write_text(json.dumps(gen))
    # the tiny tower's position table (32) takes grids up to 32 patches a side: the smallest budget
    (dest / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": 70}}))
    return dest


# ---- every named control token of Gemma 4 --------------------------------------------------------

MEDIA_SPECIALS = {"<|audio>": 123, "<|audio|>": 124, "<audio|>": 125, "<|video|>": 126}  # in unused ids


def all_controls_vocab() -> dict:
    """`gemma4_vocab` with Gemma 4's image, audio and video tokens too (in its unused ids): every
    named control token of the released tokenizer (special_tokens in the research notes), and
    unused ones beside them."""
    taken = set(IMAGE_SPECIALS.values()) | set(MEDIA_SPECIALS.values())
    vocab = {t: i for t, i in gemma4_vocab().items() if i not in taken}
    return {**vocab, **IMAGE_SPECIALS, **MEDIA_SPECIALS}


def make_all_controls_model(dest: Path) -> Path:
    """The tiny dense target with `all_controls_vocab`'s tokenizer and the released 26B/31B template."""
    shutil.copytree(TINY / "target", dest)
    write_gemma4_tokenizer(dest, GEMMA4_TEMPLATE.read_text(), all_controls_vocab())
    config = json.loads((dest / "config.json").read_text())  # room for char-level prompts
    (dest / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    gen = json.loads((dest / "generation_config.json").read_text())
    (dest / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": GEMMA4_EOS}))
    return dest


# ---- a tiny E2B-shaped chat model that takes audio ------------------------------------------------

AUDIO_SPECIALS = {"boa_token_id": 123, "audio_token_id": 124, "eoa_token_id": 125}  # MEDIA_SPECIALS' ids
SMALL_TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "gemma4-small-2026-07-14.jinja"


def make_audio_chat_model(dest: Path) -> Path:
    """The tiny E2B target (per-layer embeddings, KV-shared layers) as a `gemma4` checkpoint with an
    audio tower of tests/fixtures/audio_tower's shape (its weights random, projected to this
    target's width), Gemma 4's tokenizer with every control token and the released E2B template."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_mtp.models.gemma4_audio import Audio

    shutil.copytree(TINY.parent / "e2b" / "target", dest)
    text = {**json.loads((dest / "config.json").read_text()), "max_position_embeddings": 4096}  # 70 s of audio
    audio = json.loads((Path(__file__).parent / "fixtures" / "audio_tower" / "config.json").read_text())["audio_config"]
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
              "audio_config": audio, **AUDIO_SPECIALS, "eos_token_id": GEMMA4_EOS[:2]}
    (dest / "config.json").write_text(json.dumps(config))
    mx.random.seed(0)
    tower = Audio.from_config(config)
    mx.save_safetensors(str(dest / "audio.safetensors"), {f"model.{k}": v for k, v in tree_flatten(tower.parameters())})
    write_gemma4_tokenizer(dest, SMALL_TEMPLATE.read_text(), all_controls_vocab())
    gen = json.loads((dest / "generation_config.json").read_text())
    (dest / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": GEMMA4_EOS}))
    return dest


# ---- a tiny 12B (`gemma4_unified`) chat model that takes images and audio ---------------------------

UNIFIED = Path(__file__).parent / "fixtures" / "unified"


def make_unified_chat_model(dest: Path) -> Path:
    """tests/fixtures/unified's 12B-shaped target (encoder-free image and audio embedders) with Gemma
    4's tokenizer (its media tokens at `all_controls_vocab`'s ids), the released 31B template and a
    budget of 70 soft tokens (the fixture's position table takes 16 patches a side)."""
    shutil.copytree(UNIFIED / "target", dest)
    config = json.loads((dest / "config.json").read_text())
    ids = {"image_token_id": 121, "boi_token_id": 120, "eoi_token_id": 122, "video_token_id": 126, **AUDIO_SPECIALS}
    ids["eoa_token_index"] = ids["eoa_token_id"]
    (dest / "config.json").write_text(json.dumps({**config, **ids}))
    write_gemma4_tokenizer(dest, GEMMA4_TEMPLATE.read_text(), all_controls_vocab())
    gen = json.loads((dest / "generation_config.json").read_text())
    (dest / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": GEMMA4_EOS}))
    (dest / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": 70}}))
    return dest


def make_video_chat_model(dest: Path, variant: str = "bidir") -> Path:
    """A vision fixture as a chat model (`make_vision_chat_model`) whose tokenizer has `<|video|>` too
    (`all_controls_vocab`: the image tokens at the same ids), with the config's video token there."""
    make_vision_chat_model(dest, variant)
    write_gemma4_tokenizer(dest, GEMMA4_TEMPLATE.read_text(), all_controls_vocab())
    config = json.loads((dest / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 8192  # 32 frames of 70 soft tokens
    (dest / "config.json").write_text(json.dumps({**config, "video_token_id": MEDIA_SPECIALS["<|video|>"]}))
    return dest
