"""Render the released Gemma 4 chat templates with transformers, once, as test fixtures.

Ground truth for `mlx_mtp.formats.chat.render`: transformers' own `apply_chat_template`
(pinned transformers==5.23.0; rendering needs no torch). Usage, in a venv of its own:

    python -m venv /tmp/ref-venv && /tmp/ref-venv/bin/pip install transformers==5.23.0 jinja2
    /tmp/ref-venv/bin/python tests/reference/make_chat_renderings.py

For every template in TEMPLATES and every case in tests/fixtures/chat_templates/cases.json
(messages, tools, enable_thinking, add_generation_prompt, continue_final_message) it writes to
tests/fixtures/chat_templates/renderings.json, or the error transformers raised:

- `text`: `apply_chat_template(..., tokenize=False)`;
- `tokens`: `apply_chat_template(..., tokenize=True, return_dict=False)` (5.23 returns a flat list
  of ids). The rendered text is tokenized whole, so a control token's text inside a message
  (`<turn|>` in a user's content) becomes that control token: the injection that template mode
  must not copy (the `control_strings_in_content` case documents it);
- `tokens_sanitized`, only where it differs from `tokens`: the same with
  `sanitize_control_tokens=True` (new in 5.23), where control tokens inside messages, tools and
  kwargs are tokenized as text and only those the template writes are control tokens (or
  `error_sanitized`, if that call raised). Where it is absent the two are equal.

The Gemma 4 templates use the tests' character-level tokenizer with Gemma 4's control tokens at
their real ids and its image tokens at the vision fixtures' ids (the vocab of
`chat_helpers.write_vision_chat_files`: `gemma4_vocab()` with IMAGE_SPECIALS in place of three
unused ids), so `<bos>`, the control tokens and each `<|image|>` placeholder are one token. The
`demo` entry is the bundled demo pair's own template (mlx_mtp/demo/target/tokenizer_config.json)
with the demo's real BPE tokenizer (only `<|turn>` and `<turn|>` are control tokens there). It knows
nothing of tools, thinking or content parts and renders every case without an error: tools and
`enable_thinking` ignored, reasoning and tool calls dropped (a call is an empty model turn), a tool
result as a `tool` turn, a list of content parts as its Python repr.
`enable_thinking` is passed only where a case sets it: a template that is not told (false in
every Gemma 4 template) is what the default rendering must equal.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
DEMO = ROOT / "mlx_mtp" / "demo" / "target"  # the bundled demo pair's target: its template and BPE tokenizer
FIXTURES = TESTS / "fixtures"
OUT = FIXTURES / "chat_templates" / "renderings.json"
# name -> template file under tests/fixtures (see tests/fixtures/real_configs/SOURCES.md)
TEMPLATES = {
    "e2b-2026-04-13": "real_configs/google--gemma-4-E2B-it/chat_template.jinja",  # byte-exact google E2B
    "e4b-2026-04-29": "real_configs/google--gemma-4-E4B-it/chat_template.jinja",
    "31b-2026-04-10": "real_configs/google--gemma-4-31B-it/chat_template.jinja",  # 31B / 26B-A4B
    "small-2026-07-14": "chat_templates/gemma4-small-2026-07-14.jinja",  # ollama's copies of the
    "large-2026-07-14": "chat_templates/gemma4-large-2026-07-14.jinja",  # latest revisions
}


def render(tokenizer, case: dict) -> dict:
    kwargs = {"enable_thinking": True} if case.get("enable_thinking") else {}
    kwargs.update(tools=case.get("tools"),
                  add_generation_prompt=case.get("add_generation_prompt", True) and not case.get("continue_final_message"),
                  continue_final_message=case.get("continue_final_message", False))
    try:
        text = tokenizer.apply_chat_template(case["messages"], tokenize=False, **kwargs)
        tokens = tokenizer.apply_chat_template(case["messages"], tokenize=True, return_dict=False, **kwargs)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    out = {"text": text, "tokens": ids(tokens)}
    try:
        sanitized = ids(tokenizer.apply_chat_template(
            case["messages"], tokenize=True, return_dict=False, sanitize_control_tokens=True, **kwargs))
    except Exception as e:
        return {**out, "error_sanitized": f"{type(e).__name__}: {e}"}
    return {**out, "tokens_sanitized": sanitized} if sanitized != out["tokens"] else out


def ids(tokens) -> list:
    """The flat list of ints `apply_chat_template(tokenize=True, return_dict=False)` gives for one chat."""
    assert isinstance(tokens, list) and all(type(t) is int for t in tokens), type(tokens)
    return tokens


def dump(out: dict) -> str:
    """`out` as JSON indented by one space, as before token ids were recorded, with each id list on one line."""
    lists = []
    for template in out["templates"].values():
        for rendering in template["renderings"].values():
            for key in ("tokens", "tokens_sanitized"):
                if key in rendering:
                    lists.append(rendering[key])
                    rendering[key] = f"\0ids{len(lists) - 1}"
    text = json.dumps(out, indent=1, ensure_ascii=False)
    for i, tokens in enumerate(lists):
        text = text.replace(json.dumps(f"\0ids{i}"), json.dumps(tokens), 1)
    return text + "\n"


def main() -> None:
    import transformers
    from transformers import AutoTokenizer

    sys.path.insert(0, str(TESTS))
    from chat_helpers import IMAGE_SPECIALS, gemma4_vocab, write_gemma4_tokenizer

    # write_vision_chat_files' vocab: the text ids are gemma4_vocab's, three unused ids become image tokens
    vocab = {t: i for t, i in gemma4_vocab().items() if i not in IMAGE_SPECIALS.values()}
    vocab = {**vocab, **IMAGE_SPECIALS}
    cases = json.loads((FIXTURES / "chat_templates" / "cases.json").read_text())
    out = {"transformers": transformers.__version__, "templates": {}}
    for name, rel in TEMPLATES.items():
        template = (FIXTURES / rel).read_text()
        with tempfile.TemporaryDirectory() as tmp:
            write_gemma4_tokenizer(Path(tmp), template, vocab)
            tokenizer = AutoTokenizer.from_pretrained(tmp)
            out["templates"][name] = {
                "file": rel, "sha256": hashlib.sha256(template.encode()).hexdigest(),
                "renderings": {case["name"]: render(tokenizer, case) for case in cases},
            }
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    out["templates"]["demo"] = {
        "file": str(DEMO.relative_to(ROOT) / "tokenizer_config.json"),  # relative to the repository root
        "sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
        "renderings": {case["name"]: render(tokenizer, case) for case in cases},
    }
    OUT.write_text(dump(out))
    print(f"wrote {OUT} (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
