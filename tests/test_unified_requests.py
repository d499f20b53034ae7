"""The 12B (`gemma4_unified`) with images and audio in requests, on the tiny 12B-shaped fixture
(chat_helpers.make_unified_chat_model): raw 48-pixel patches and 640-sample frames through its
embedders, one soft token each, images bidirectional within the window and audio causal; greedy MTP
equals plain and a batch row what it gives alone, past the sliding window."""

import numpy as np
import pytest
from chat_helpers import UNIFIED, make_unified_chat_model
from PIL import Image

import mlx_mtp
from mlx_mtp.formats import audio as audio_io, images as image_io

IMAGE, AUDIO = 121, 124


def picture(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def tone(seconds: float, hz: float = 440.0) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * hz * np.arange(int(seconds * 16000)) / 16000)).astype(np.float32)


def ask(*parts, text="What is this?", **options) -> mlx_mtp.Request:
    return mlx_mtp.Request(messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], **options)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_mtp.load(make_unified_chat_model(tmp_path_factory.mktemp("unified") / "model"), UNIFIED / "drafter")


def test_images_and_audio_become_one_soft_token_a_patch_and_a_frame(loaded):
    assert loaded.vision is loaded.audio and not loaded.vision.loaded  # one module of embedders, read when needed
    with mlx_mtp.Engine(loaded) as engine:
        handle = engine.submit(ask({"type": "image", "image": picture(100, 140)},
                                   {"type": "audio", "audio": tone(1.0)}, max_tokens=1))
        handle.result()
    tokens, placed = handle._prepared.tokens, handle._prepared.images
    h, w = image_io.target_size(100, 140, 70, 16, 3)
    assert tokens.count(IMAGE) == (h // 48) * (w // 48) and tokens.count(AUDIO) == audio_io.unified_tokens(16000) == 25
    assert placed.causal == (False, True)  # the image's tokens see each other; the clip's stay causal
    rows = placed.rows(0, len(tokens))
    starts, ends = (np.array(a)[0].tolist() for a in rows.blocks)
    assert [(s, e) for s, e in zip(starts, ends)] == [placed.spans[0]]  # only the image is a block


def test_greedy_mtp_equals_plain_and_a_batch_row_equals_alone(loaded):
    request = ask({"type": "image", "image": picture(60, 100, 1)}, {"type": "audio", "audio": tone(0.6)},
                  max_tokens=40, draft_tokens=3)
    with mlx_mtp.Engine(loaded, max_batch=3) as engine:
        plain = engine.submit(ask({"type": "image", "image": picture(60, 100, 1)},
                                  {"type": "audio", "audio": tone(0.6)}, max_tokens=40, mtp=False)).result()
        alone = engine.submit(request).result()
        batch = [engine.submit(r) for r in (request, mlx_mtp.Request(prompt="hello", max_tokens=20),
                                            ask({"type": "audio", "audio": tone(0.3, 660)}, max_tokens=20))]
        together = [h.result() for h in batch]
    assert len(plain.tokens) == 40 and alone.tokens == plain.tokens == together[0].tokens
    assert alone.stats.drafted > alone.stats.accepted  # an independent random drafter: rejections


def test_the_12b_takes_media_through_the_openai_api(loaded):
    import base64
    import io

    import soundfile
    from starlette.testclient import TestClient

    from mlx_mtp.server.app import Settings, create_app, served_model

    wav, png = io.BytesIO(), io.BytesIO()
    soundfile.write(wav, tone(0.5), 16000, format="WAV")
    picture(50, 50).save(png, format="PNG")
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"}},
        {"type": "text", "text": "Describe both."}]}]}
    with mlx_mtp.Engine(loaded) as engine, TestClient(create_app(engine, Settings(served_model(loaded, "m")))) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > audio_io.unified_tokens(8000) + 1
