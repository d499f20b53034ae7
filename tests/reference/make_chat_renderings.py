"""Render the released Gemma 4 chat templates with transformers, once, as test fixtures.

Ground truth for `mlx_mtp.formats.chat.render`: transformers' own `apply_chat_template`
(pinned transformers==5.23.0; rendering needs no torch). Usage, in a venv of its own:

    python -m venv /tmp/ref-venv && /tmp/ref-venv/bin/pip install transformers==5.23.0 jinja2
    /tmp/ref-venv/bin/python tests/reference/make_chat_renderings.py

For every template in TEMPLATES and every case in tests/fixtures/chat_templates/cases.json
(messages, tools, enable_thinking, add_generation_prompt, continue_final_message) it writes the
rendered text, or the error transformers raised, to tests/fixtures/chat_templates/renderings.json.
The tokenizer is the tests' character-level one with Gemma 4's control tokens
(`chat_helpers.write_gemma4_tokenizer`), so `<bos>` and the control tokens are Gemma 4's.
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
    try:
        text = tokenizer.apply_chat_template(
            case["messages"], tools=case.get("tools"), tokenize=False,
            add_generation_prompt=case.get("add_generation_prompt", True) and not case.get("continue_final_message"),
            continue_final_message=case.get("continue_final_message", False), **kwargs)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"text": text}


def main() -> None:
    import transformers
    from transformers import AutoTokenizer

    sys.path.insert(0, str(TESTS))
    from chat_helpers import write_gemma4_tokenizer

    cases = json.loads((FIXTURES / "chat_templates" / "cases.json").read_text())
    out = {"transformers": transformers.__version__, "templates": {}}
    for name, rel in TEMPLATES.items():
        template = (FIXTURES / rel).read_text()
        with tempfile.TemporaryDirectory() as tmp:
            write_gemma4_tokenizer(Path(tmp), template)
            tokenizer = AutoTokenizer.from_pretrained(tmp)
            out["templates"][name] = {
                "file": rel, "sha256": hashlib.sha256(template.encode()).hexdigest(),
                "renderings": {case["name"]: render(tokenizer, case) for case in cases},
            }
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
