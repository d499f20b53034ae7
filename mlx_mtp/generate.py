"""Generation for one sequence: prefill, then speculative (or plain) rounds, streamed."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Optional, Sequence, Union

import mlx.core as mx

from .cache import KVCache
from .models.base import Drafter, TargetModel
from .sample import SamplingParams, probs, sample, split_key
from .speculative import DraftLength, RoundState, Timer, run_round
from .stats import Stats
from .threads import mark_mlx_thread


class ContextLengthError(ValueError):
    """A prompt (plus generation) that does not fit the model's context."""


@dataclasses.dataclass
class Event:
    """One streamed step: new text and the token that produced it."""

    text: str
    token: int
    from_draft: bool
    finish_reason: Optional[str]  # None while streaming, then "stop" or "length"
    stats: Stats


def prefill(
    target: TargetModel, cache: KVCache, tokens: Sequence[int], step: int = 512
) -> tuple[mx.array, RoundState]:
    """Run `tokens` through the target in chunks.

    Returns:
        (logits of the last position (1, V), state whose `tokens`/`hidden` are the last
        prompt token's, i.e. the caller samples the first new token from the logits).
    """
    if not tokens:
        raise ValueError("empty prompt: nothing to condition on")
    ids = mx.array([list(tokens)], dtype=mx.int32)
    for start in range(0, ids.shape[1] - step, step):
        target(ids[:, start : start + step], cache)
        mx.eval(cache.keys, cache.values)
    last = ids.shape[1] - (ids.shape[1] - 1) % step - 1
    out = target(ids[:, last:], cache)
    hidden = out.hidden[:, -1]
    # Only the last position's logits: never materialise (L, V) for a long prompt.
    logits = target.logits(hidden)
    return logits, RoundState(ids[:, -1], hidden, out.shared_kv)


def check_context(target: TargetModel, cache: KVCache, n_prompt: int) -> None:
    limit = target.config.max_position_embeddings
    total = int(cache.offset.max()) + n_prompt
    if total >= limit:
        raise ContextLengthError(
            f"prompt of {n_prompt} tokens (plus {total - n_prompt} in the cache) does not fit the "
            f"model's context of {limit} tokens"
        )


def generate_tokens(
    target: TargetModel,
    prompt: Sequence[int],
    *,
    drafter: Optional[Drafter] = None,
    cache: Optional[KVCache] = None,
    sampling: SamplingParams = SamplingParams(),
    draft_tokens: Union[int, str] = "auto",
    max_tokens: int = 256,
    stop_ids: Sequence[int] = (),
    seed: Optional[int] = None,
    stats: Optional[Stats] = None,
) -> Iterator[tuple[int, bool]]:
    """Yield (token, from_draft) pairs; with no drafter (or draft_tokens=0) this is plain
    decoding. The output equals plain decoding's exactly (greedy) or in distribution.

    `cache` may carry earlier turns: it holds every token of the conversation but the last
    one, and `prompt` continues from there (starting with that last token).
    """
    mark_mlx_thread()
    policy = DraftLength(draft_tokens if drafter is not None else 0)
    if cache is None:
        cache = target.make_cache(1, max_rollback=policy.k_max + 1)
    elif cache.max_rollback < policy.k_max + 1:
        raise ValueError(f"cache allows rollback of {cache.max_rollback} tokens; need {policy.k_max + 1}")
    if drafter is not None:
        drafter.check_target(target)
    check_context(target, cache, len(prompt))
    stats = stats if stats is not None else Stats()
    key = mx.random.key(seed) if seed is not None else None
    stop = frozenset(stop_ids)
    limit = target.config.max_position_embeddings

    started = time.perf_counter()
    logits, state = prefill(target, cache, prompt)
    key, sub = split_key(key)
    first = sample(probs(logits, sampling), sub)
    state = RoundState(first.astype(mx.int32), state.hidden, state.shared_kv)
    token = int(first.item())
    stats.prompt_tokens += len(prompt)
    stats.prompt_seconds = stats.first_token_seconds = time.perf_counter() - started
    stats.emitted += 1
    yield token, False
    if token in stop or max_tokens <= 1:
        return

    if drafter is None or draft_tokens == 0:
        yield from plain_loop(target, cache, state.tokens, sampling, max_tokens - 1, stop, key, stats)
        return
    timer, decode_start, left = Timer(), time.perf_counter(), max_tokens - 1
    unyielded = 0  # tokens of the current round already in the cache but not handed out
    try:
        while left > 0:
            room = limit - int(cache.offset[0]) - 1
            if room <= 0:
                raise ContextLengthError(f"generation reached the model's context of {limit} tokens")
            if policy.next() == 0:  # drafting is off for a while: pipelined plain decoding
                run = PlainRun()
                key, sub = split_key(key)
                yield from plain_loop(target, cache, state.tokens, sampling, min(policy.off_for, left, room),
                                      stop, sub, stats, run, decode_start)
                policy.observe_plain(run.emitted, timer.lap())
                left -= run.emitted
                if run.state is None or int(run.state.tokens[0].item()) in stop:
                    return
                state = run.state
                continue
            k = min(policy.next(), room - 1) if room > 1 else 0
            key, sub = split_key(key)
            result = run_round(target, drafter, cache, state, k, sampling, [left], [stop], sub)
            emitted, state = result.emitted[0], result.state
            policy.observe(k, result.accepted[0], len(emitted), timer.lap())
            stats.observe_round(k, result.accepted[0])
            unyielded = len(emitted)
            for i, tok in enumerate(emitted):
                from_draft = i < result.accepted[0]
                stats.emitted += 1
                stats.from_draft += from_draft
                stats.decode_seconds = time.perf_counter() - decode_start
                unyielded -= 1
                yield tok, from_draft
            left -= len(emitted)
            if emitted[-1] in stop:
                return
    finally:
        if unyielded:  # the caller stopped inside a round's block
            cache.trim(unyielded)


@dataclasses.dataclass
class PlainRun:
    """What a stretch of plain decoding leaves behind for speculative rounds to resume from."""

    state: Optional[RoundState] = None
    emitted: int = 0


def plain_loop(
    target: TargetModel, cache: KVCache, token: mx.array, sampling: SamplingParams, n: int,
    stop: frozenset, key: Optional[mx.array], stats: Stats, run: Optional[PlainRun] = None,
    decode_start: Optional[float] = None,
) -> Iterator[tuple[int, bool]]:
    """Plain decoding of up to `n` tokens, pipelined: step t+1 is scheduled before token t
    is handed out. The token fed ahead is trimmed again on exit (the cache holds all but the
    last token), and `run` receives the state a speculative round needs to resume."""
    limit = target.config.max_position_embeddings
    run = run if run is not None else PlainRun()

    def step(y, key):
        hidden = target(y[:, None], cache).hidden[:, -1]
        logits = target.logits(hidden)
        if sampling.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32), hidden
        return sample(probs(logits, sampling), key), hidden

    def next_key():
        nonlocal key
        key, sub = split_key(key)
        return sub

    decode_start = time.perf_counter() if decode_start is None else decode_start
    fed = 1
    y, hidden = step(token, next_key())
    mx.async_eval(y)
    try:
        for i in range(n):
            nxt = None
            if i < n - 1:
                if int(cache.offset[0]) + 1 >= limit:
                    raise ContextLengthError(f"generation reached the model's context of {limit} tokens")
                nxt = step(y, next_key())
                fed += 1
                mx.async_eval(nxt[0])
            tok = int(y.item())
            run.emitted += 1
            stats.plain_steps += 1
            stats.emitted += 1
            stats.decode_seconds = time.perf_counter() - decode_start
            run.state = RoundState(y, hidden, None)
            yield tok, False
            if tok in stop or nxt is None:
                return
            y, hidden = nxt
    finally:
        # Tokens fed ahead of what was handed out leave the cache: it holds all but the last.
        if fed > run.emitted:
            cache.trim(fed - run.emitted)
        if run.state is not None:
            run.state.shared_kv = target.shared_kv(cache)


@dataclasses.dataclass
class Result:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: Stats


def stream_generate(
    loaded,
    prompt: Union[str, Sequence[int]],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams = SamplingParams(),
    draft_tokens: Union[int, str] = "auto",
    mtp: bool = True,
    seed: Optional[int] = None,
    cache: Optional[KVCache] = None,
) -> Iterator[Event]:
    """Stream a completion of `prompt` (text, or token ids) from a `load()`ed model.

    Each event carries the new text, the token, whether it came from an accepted draft,
    and the running statistics; the last one has `finish_reason` "stop" or "length".
    """
    tokenizer = loaded.tokenizer
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        prompt = tokenizer.encode(prompt)
    detok = tokenizer.detokenizer if tokenizer is not None else None
    if detok is not None:
        detok.reset()
    stats = Stats()
    tokens = generate_tokens(
        loaded.target, prompt, drafter=loaded.drafter if mtp else None, cache=cache, sampling=sampling,
        draft_tokens=draft_tokens, max_tokens=max_tokens, stop_ids=loaded.eos_ids, seed=seed, stats=stats,
    )
    n = 0
    for token, from_draft in tokens:
        n += 1
        finish = "stop" if token in loaded.eos_ids else ("length" if n >= max_tokens else None)
        text = ""
        if detok is not None:
            if finish != "stop":
                detok.add_token(token)
            if finish:
                detok.finalize()
            text = detok.last_segment
        yield Event(text, token, from_draft, finish, stats)


def generate(loaded, prompt: Union[str, Sequence[int]], **kwargs) -> Result:
    """Generate a whole completion; see `stream_generate` for the arguments."""
    text, tokens, event = [], [], None
    for event in stream_generate(loaded, prompt, **kwargs):
        text.append(event.text)
        tokens.append(event.token)
    return Result("".join(text), tokens, event.finish_reason or "length", event.stats)
