"""Which fields each API takes, at the top of a request and inside its messages, blocks and tools:
any other is refused (400, in the API's own words), as OpenAI and Anthropic refuse it, so that a
misspelt field (`temprature`) is never silently ignored.

The allowlists are the fields of the official clients' request types (openai 3.57, anthropic 2.15
with its beta API, which Claude Code uses), what Claude Code 2.x sends, and this server's own
extensions (README: "Extensions"). Fields listed here are not all honoured: `protocol` and
`anthropic` refuse those whose meaning they cannot keep, and check the type of those they ignore.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

# ---- OpenAI ----------------------------------------------------------------------------------------

OPENAI_CHAT = frozenset({
    "model", "messages", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options"})
OPENAI_COMPLETION = frozenset({
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user"})
# This server's, and vLLM's it takes (chat_template_kwargs on chat only).
OPENAI_EXTENSIONS = frozenset({"draft_tokens", "mtp", "top_k", "min_p", "repetition_penalty", "structured_outputs",
                               "keep_alive"})
HISTORY_EXTENSIONS = frozenset({"history", "keep_thinking"})  # chats' (README: "Histories as generated")
# Per message role; `reasoning_content` / `reasoning` are the reasoning that llama.cpp's and vLLM's
# clients send back, `name` on a tool result is what older clients send instead of an id.
OPENAI_MESSAGE = {
    "system": {"role", "content", "name"}, "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "function_call", "audio", "refusal",
                  "reasoning_content", "reasoning"},
    "tool": {"role", "content", "tool_call_id", "name"},
}
OPENAI_PART = {"text": {"type", "text", "prompt_cache_breakpoint"},
               "image_url": {"type", "image_url", "prompt_cache_breakpoint"},
               "input_audio": {"type", "input_audio"}, "file": {"type", "file"},
               "video_url": {"type", "video_url"}}  # vLLM's (OpenAI's API has no video part)
OPENAI_CALL = {"id", "type", "function", "index"}  # `index`: clients that send a stream's calls back as they came
OPENAI_FUNCTION = {"name", "arguments"}
OPENAI_TOOL = {"type", "function"}
OPENAI_TOOL_FUNCTION = {"name", "description", "parameters", "strict"}

# ---- Anthropic -------------------------------------------------------------------------------------

_ANTHROPIC_COMMON = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                     "output_format", "cache_control", "speed", "mcp_servers", "context_management", "betas",
                     "compaction", "billing_policy", "user_profile_id", "workspace_id"}
ANTHROPIC_MESSAGES = frozenset(_ANTHROPIC_COMMON | {
    "max_tokens", "metadata", "stop_sequences", "stream", "temperature", "top_k", "top_p", "service_tier",
    "container", "diagnostics", "inference_geo", "fallbacks", "fallback_credit_token", "thread"})
# count_tokens takes what /v1/messages takes: the body about to be sent is counted as it is.
ANTHROPIC_COUNT = ANTHROPIC_MESSAGES
ANTHROPIC_EXTENSIONS = frozenset({"draft_tokens", "mtp", "min_p", "structured_outputs", "keep_alive"}) | HISTORY_EXTENSIONS
ANTHROPIC_MESSAGE = {"role", "content"}
ANTHROPIC_BLOCK = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
ANTHROPIC_TOOL = {"name", "description", "input_schema", "cache_control", "strict", "type", "defer_loading",
                  "eager_input_streaming", "input_examples", "allowed_callers"}
ANTHROPIC_TOOL_CHOICE = {"type", "name", "disable_parallel_tool_use"}
ANTHROPIC_THINKING = {"type", "budget_tokens", "display"}
ANTHROPIC_METADATA = {"user_id"}
ANTHROPIC_OUTPUT_CONFIG = {"effort", "format"}


# ---- Ollama ----------------------------------------------------------------------------------------
# The fields of the official client's request types (ollama 0.6) and of Ollama's api/types.go.

_OLLAMA_COMMON = {"model", "format", "options", "stream", "keep_alive", "think", "logprobs", "top_logprobs"}
OLLAMA_CHAT = frozenset(_OLLAMA_COMMON | {"messages", "tools"})
OLLAMA_GENERATE = frozenset(_OLLAMA_COMMON | {"prompt", "suffix", "system", "template", "context", "raw", "images",
                                              "width", "height", "steps"})
OLLAMA_EXTENSIONS = frozenset({"draft_tokens", "mtp", "structured_outputs"}) | HISTORY_EXTENSIONS
OLLAMA_MESSAGE = {"role", "content", "thinking", "images", "tool_calls", "tool_name", "tool_call_id"}
OLLAMA_CALL = {"id", "type", "function"}
OLLAMA_FUNCTION = {"index", "name", "arguments"}
OLLAMA_OPTIONS = frozenset({
    "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
    "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "seed", "num_predict", "top_k", "top_p",
    "min_p", "tfs_z", "typical_p", "repeat_last_n", "temperature", "repeat_penalty", "presence_penalty",
    "frequency_penalty", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline", "stop"})


def extra(obj: Any, allowed: Iterable[str]) -> list:
    """The keys of `obj` (a dict; anything else has none) that `allowed` does not hold, in order."""
    if not isinstance(obj, dict):
        return []
    allowed = allowed if isinstance(allowed, (set, frozenset)) else set(allowed)
    return [k for k in obj if k not in allowed]


def first_extra(checks: Iterable[tuple[str, Any, Iterable[str]]]) -> Optional[str]:
    """The path (`where.key`) of the first unknown field among (where, object, allowed) checks."""
    for where, obj, allowed in checks:
        for key in extra(obj, allowed):
            return f"{where}.{key}" if where else str(key)
    return None
