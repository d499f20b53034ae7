"""Audio in requests, end to end on a tiny E2B-shaped chat model with an audio tower
(chat_helpers.make_audio_chat_model): the tower is read with the first clip, a clip's placeholder
becomes its soft tokens, long audio is split and never cut, greedy MTP equals plain after audio,
an audio row in a batch gives what it gives alone, the prefix cache keys a clip by its content, and
bad audio is one clear error that disturbs nothing else."""

import io

import numpy as np
import pytest
import soundfile
from chat_helpers import AUDIO_SPECIALS, TINY, make_audio_chat_model

import mlx_mtp
from mlx_mtp.engine.prepare import Preparer
from mlx_mtp.formats import audio as audio_io
from mlx_mtp.formats.audio import AudioError

DRAFTER = TINY.parent / "e2b" / "drafter"
BOA, AUDIO, EOA = (AUDIO_SPECIALS[k] for k in ("boa_token_id", "audio_token_id", "eoa_token_id"))


def tone(seconds: float, hz: float = 440.0, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def ask(clip, text: str = "What is this?", **options) -> mlx_mtp.Request:
    part = {"type": "audio", "audio": clip} if not isinstance(clip, list) else clip[0]
    return mlx_mtp.Request(messages=[{"role": "user", "content": [part, {"type": "text", "text": text}]}], **options)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_audio_chat_model(tmp_path_factory.mktemp("audio") / "model")


@pytest.fixture(scope="module")
def loaded(model):
    return mlx_mtp.load(model, DRAFTER)


def blocks(tokens: list) -> list[int]:
    """The soft-token count of each audio block of a prompt."""
    out, i = [], 0
    while BOA in tokens[i:]:
        i = tokens.index(BOA, i) + 1
        j = tokens.index(EOA, i)
        assert set(tokens[i:j]) <= {AUDIO}
        out.append(j - i)
        i = j
    return out


def test_a_clip_becomes_its_soft_tokens_and_the_tower_loads_with_the_first(model):
    loaded = mlx_mtp.load(model, DRAFTER)
    with mlx_mtp.Engine(loaded) as engine:
        engine.submit(mlx_mtp.Request(messages=[{"role": "user", "content": "hi"}], max_tokens=2)).result()
        assert not loaded.audio.loaded  # text only: never read
        handle = engine.submit(ask(tone(1.5), max_tokens=2))
        handle.result()
    assert loaded.audio.loaded
    assert blocks(handle._prepared.tokens) == [audio_io.audio_tokens(24000)] == [38]
    assert Preparer(loaded).count(ask(tone(1.5))) == len(handle._prepared.tokens)  # counted without the tower
    assert mlx_mtp.load(model, load_audio=True).audio.loaded


def test_long_audio_is_split_into_pieces_never_cut(loaded):
    handle = None
    with mlx_mtp.Engine(loaded) as engine:
        handle = engine.submit(ask(tone(70.0), max_tokens=1))
        handle.result()
    pieces = audio_io.segments(tone(70.0))
    assert len(pieces) == 3 and blocks(handle._prepared.tokens) == [audio_io.audio_tokens(len(p)) for p in pieces]


def test_greedy_mtp_equals_plain_after_audio_and_a_batch_row_equals_alone(loaded):
    """Past the sliding window (8), with a drafter whose drafts are mostly rejected."""
    hot = mlx_mtp.SamplingParams(temperature=1.0)
    with mlx_mtp.Engine(loaded, max_batch=4) as engine:
        plain = engine.submit(ask(tone(1.0), max_tokens=40, mtp=False)).result()
        mtp = engine.submit(ask(tone(1.0), max_tokens=40, draft_tokens=3)).result()
        alone = engine.submit(ask(tone(1.0, 300), max_tokens=24, sampling=hot, seed=5, draft_tokens=3)).result()
        batch = [engine.submit(r) for r in (
            ask(tone(1.0, 300), max_tokens=24, sampling=hot, seed=5, draft_tokens=3),
            mlx_mtp.Request(prompt="def f(x):", max_tokens=24),
            ask(tone(1.0), max_tokens=40, draft_tokens=3))]
        together = [h.result() for h in batch]
    assert len(plain.tokens) > 16 and mtp.tokens == plain.tokens
    assert mtp.stats.drafted > mtp.stats.accepted  # rejections happened
    assert together[0].tokens == alone.tokens and together[2].tokens == plain.tokens


def test_the_prefix_cache_keys_a_clip_by_its_content(loaded):
    with mlx_mtp.Engine(loaded) as engine:
        first = engine.submit(ask(tone(1.0), max_tokens=1))
        first.result()
        again = engine.submit(ask(tone(1.0), "Say more.", max_tokens=1))
        again.result()
        other = engine.submit(ask(tone(1.0, 660.0), max_tokens=1))
        other.result()
    start = first._prepared.tokens.index(BOA) + 1
    assert again.cached_tokens > start + 25  # the same clip: read from the cache
    assert other.cached_tokens <= start  # another clip of the same length: never


def test_audio_as_files_bytes_and_data_urls(loaded, tmp_path):
    buf = io.BytesIO()
    soundfile.write(buf, np.stack([tone(1.0, rate=44100)] * 2, 1), 44100, format="FLAC")  # stereo, 44.1 kHz
    (tmp_path / "clip.flac").write_bytes(buf.getvalue())
    preparer = Preparer(loaded)
    counts = [blocks(preparer.one_shot(ask(source, max_tokens=1))[1].tokens)
              for source in (str(tmp_path / "clip.flac"), buf.getvalue())]
    assert counts == [[audio_io.audio_tokens(16000)]] * 2


def test_bad_audio_is_one_clear_error_and_disturbs_nothing(loaded):
    with mlx_mtp.Engine(loaded) as engine:
        for bad, match in ((b"not audio at all" * 10, "audio"), (np.zeros(0, np.float32), "0 s|empty|no sample"),
                           ("/no/such/clip.wav", "no audio file at")):
            with pytest.raises(AudioError, match=match) as error:
                engine.submit(ask(bad, max_tokens=1))
            assert "\n" not in str(error.value) and "object at 0x" not in str(error.value)
        assert engine.submit(ask(tone(0.5), max_tokens=2)).result().finish_reason in ("stop", "length")


def test_a_model_without_an_audio_tower_says_so():
    from mlx_mtp.demo import DRAFTER_DIR, TARGET_DIR

    demo = mlx_mtp.load(TARGET_DIR, DRAFTER_DIR)
    with pytest.raises(AudioError, match="takes no audio"):
        Preparer(demo).one_shot(ask(tone(0.5)))


def test_the_disk_tier_keys_a_clip_by_its_content_too(loaded, tmp_path):
    for clip, reused in ((tone(1.0), False), (tone(1.0), True), (tone(1.0, 660.0), False)):
        with mlx_mtp.Engine(loaded, prompt_cache_dir=tmp_path / "cache") as engine:  # a new process's engine
            handle = engine.submit(ask(clip, max_tokens=1))
            handle.result()
        start = handle._prepared.tokens.index(BOA) + 1
        assert (handle.cached_tokens > start + 25) == reused, (handle.cached_tokens, start)


def test_the_apis_take_audio_as_each_says(loaded):
    """OpenAI's `input_audio` parts (base64 wav or mp3); Anthropic's API has no audio block: a clear
    400; bad audio a 400 in each API's shape, the server serving on."""
    import base64

    from starlette.testclient import TestClient

    from mlx_mtp.server.app import Settings, create_app, served_model

    buf = io.BytesIO()
    soundfile.write(buf, tone(1.0), 16000, format="WAV")
    clip = base64.b64encode(buf.getvalue()).decode()

    def openai_body(data: str, fmt: str = "wav") -> dict:
        return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}, {"type": "text", "text": "Hm?"}]}]}

    with mlx_mtp.Engine(loaded) as engine, TestClient(create_app(engine, Settings(served_model(loaded, "m")))) as c:
        ok = c.post("/v1/chat/completions", json=openai_body(clip))
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > audio_io.audio_tokens(16000), ok.text
        for body, words in ((openai_body(clip, "aac"), "Supported values are: 'wav' and 'mp3'"),
                            (openai_body("%%%"), "not valid base64"),
                            (openai_body(base64.b64encode(b"RIFF" + b"x" * 100).decode()), "audio")):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        r = c.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}]}]})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert "takes no audio or video" in r.json()["error"]["message"]
        assert c.post("/v1/chat/completions", json=openai_body(clip)).status_code == 200  # still serving


def test_the_chat_takes_audio(model, tmp_path):
    import subprocess
    import sys

    soundfile.write(tmp_path / "clip.wav", tone(1.0), 16000)
    lines = f"/audio {tmp_path / 'missing.wav'}\n/audio {tmp_path / 'clip.wav'}\nWhat is this?\nAnd now?\n"
    out = subprocess.run([sys.executable, "-m", "mlx_mtp.chat", "--model", str(model), "--drafter", str(DRAFTER),
                          "--max-tokens", "4"], input=lines, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "error: no audio file at" in out.stderr and "goes with your next message" in out.stderr
    assert out.stderr.count(" from the prompt") == 2  # both turns answered, the first with the clip


def test_convert_keeps_the_audio_tower(model, loaded, tmp_path):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from convert import convert

    out = tmp_path / "converted"
    convert(model, out, dtype="float32", progress=False)
    converted = mlx_mtp.load(out, DRAFTER)
    assert converted.audio is not None and not converted.audio.loaded
    request = ask(tone(1.0), max_tokens=12, mtp=False)
    with mlx_mtp.Engine(loaded) as a, mlx_mtp.Engine(converted) as b:
        assert a.submit(request).result().tokens == b.submit(request).result().tokens
    bf16 = tmp_path / "bf16"
    convert(model, bf16, progress=False)  # --dtype's default
    tower = mlx_mtp.load(bf16).audio.get()
    assert {v.dtype for _, v in tree_flatten(tower.parameters())} == {mx.bfloat16}


def test_mtp_sampling_after_audio_follows_the_target_law(loaded):
    """As tests/test_vision_generate.py's after images: the first two sampled tokens of 400 rows after
    an audio prompt, drafted by an independently random drafter, against the exact laws p1 and p1 @ p(. | x)."""
    import mlx.core as mx
    from test_sample import STRICT, _chi2

    from mlx_mtp.decode.drafters import MTPProposer
    from mlx_mtp.decode.sample import SamplingParams, probs
    from mlx_mtp.decode.speculative import BatchState
    from mlx_mtp.models.gemma4_vision import ImageRows
    from test_vision_generate import first_two

    target, drafter = loaded.target, loaded.drafter
    prepared = Preparer(loaded).one_shot(ask(tone(0.5)))[1]
    ids, audio, L = prepared.tokens, prepared.images, len(prepared.tokens)

    def tiled(rows: int, length: int) -> ImageRows:  # the clip in each of `rows` rows of one forward
        one = audio.rows(0, length)
        return ImageRows(mx.concatenate([one.rows + r * length for r in range(rows)]),
                         mx.concatenate([one.features] * rows), None)

    n, K, sampling = 400, 2, SamplingParams(temperature=1.0, top_k=40)
    cache = target.make_cache(n, max_rollback=2 * K + 2)
    out = target(mx.array([ids] * n), cache, images=tiled(n, L))
    bonus = int(mx.argmax(out.logits[0, -1]))
    seeds = mx.array(np.random.default_rng(0).integers(0, 2**32, n), dtype=mx.uint32)
    state = BatchState(mx.full((n,), bonus, dtype=mx.int32), out.hidden[:, -1], seeds)
    first, second, accepted = first_two(target, MTPProposer(drafter, target), cache, state, sampling, K)
    context = ids + [bonus]
    vocab = target.config.vocab_size
    nxt = target(mx.array([context + [x] for x in range(vocab)]), images=tiled(vocab, L + 2)).logits[:, -1]
    p_next = np.array(probs(target(mx.array([context]), images=audio.rows(0, L + 1)).logits[0, -1], sampling))
    p2 = p_next @ np.array(probs(nxt, sampling))
    for tokens, law in ((first, p_next), (second, p2)):
        assert _chi2(np.bincount(tokens, minlength=vocab), law)[2] > STRICT
    assert 0.05 < accepted < 0.95  # drafts were both accepted and rejected
