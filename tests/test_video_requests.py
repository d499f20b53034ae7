"""Video in requests, end to end on the tiny vision chat model (chat_helpers.make_video_chat_model)
and the tiny 12B: each sampled frame after its `mm:ss` timestamp, through the model's image path,
its own bidirectional block; greedy MTP equals plain past the window, a batch row what it gives
alone, the prefix cache keys frames by their content; the APIs and the chat take it."""

import base64
from pathlib import Path

import pytest
from chat_helpers import DRAFTER, UNIFIED, make_unified_chat_model, make_video_chat_model

import mlx_mtp
from mlx_mtp.engine.prepare import Preparer
from mlx_mtp.formats import video as video_io
from mlx_mtp.formats.video import VideoError

pytest.importorskip("av")
CLIP = Path(__file__).parent / "fixtures" / "video" / "clip.mp4"
VIDEO = 126


def ask(source, text="What happens?", **options) -> mlx_mtp.Request:
    return mlx_mtp.Request(messages=[{"role": "user", "content": [{"type": "video", "video": source},
                                                                  {"type": "text", "text": text}]}], **options)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_mtp.load(make_video_chat_model(tmp_path_factory.mktemp("video") / "model"), DRAFTER)


def test_each_frame_after_its_timestamp_through_the_image_path(loaded):
    clip = video_io.load_video(str(CLIP))
    with mlx_mtp.Engine(loaded) as engine:
        handle = engine.submit(ask(str(CLIP), max_tokens=1))
        handle.result()
    tokens, placed = handle._prepared.tokens, handle._prepared.images
    text = loaded.tokenizer.decode(tokens)
    assert clip.prompt() in text  # transformers' expansion, timestamps and all
    assert tokens.count(VIDEO) == len(clip.indices) * clip.tokens() and len(placed.spans) == len(clip.indices)
    assert placed.causal == (False,) * len(clip.indices)  # each frame a block of its own
    assert Preparer(loaded).count(ask(str(CLIP))) == len(tokens)


def test_greedy_mtp_equals_plain_after_video_and_a_batch_row_equals_alone(loaded):
    with mlx_mtp.Engine(loaded, max_batch=3) as engine:
        plain = engine.submit(ask(str(CLIP), max_tokens=32, mtp=False)).result()
        mtp = engine.submit(ask(str(CLIP), max_tokens=32, draft_tokens=3)).result()
        batch = [engine.submit(r) for r in (ask(CLIP.read_bytes(), max_tokens=32, draft_tokens=3),
                                            mlx_mtp.Request(prompt="hello", max_tokens=16))]
        together = [h.result() for h in batch]
        again = engine.submit(ask(str(CLIP), "And then?", max_tokens=1))
        again.result()
    assert len(plain.tokens) == 32 and mtp.tokens == plain.tokens == together[0].tokens
    assert again.cached_tokens > len(video_io.load_video(str(CLIP)).indices) * 10  # its frames read from the cache


def test_the_12b_takes_video_through_its_patches(tmp_path):
    model = mlx_mtp.load(make_unified_chat_model(tmp_path / "m"), UNIFIED / "drafter")
    with mlx_mtp.Engine(model) as engine:
        handle = engine.submit(ask(str(CLIP), max_tokens=8, draft_tokens=3))
        done = handle.result()
    clip = video_io.load_video(str(CLIP))
    assert done.finish_reason in ("stop", "length") and len(handle._prepared.images.spans) == len(clip.indices)


def test_bad_video_is_one_clear_error(loaded):
    with mlx_mtp.Engine(loaded) as engine:
        for bad in (b"not a video at all" * 20, "/no/such/clip.mp4"):
            with pytest.raises(VideoError) as error:
                engine.submit(ask(bad, max_tokens=1))
            assert "\n" not in str(error.value)
        assert engine.submit(ask(str(CLIP), max_tokens=1)).result().finish_reason in ("stop", "length")


def test_the_apis_and_the_chat_take_video(loaded, tmp_path):
    import subprocess
    import sys

    from starlette.testclient import TestClient

    from mlx_mtp.server.app import Settings, create_app, served_model

    url = "data:video/mp4;base64," + base64.b64encode(CLIP.read_bytes()).decode()
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]}]}
    with mlx_mtp.Engine(loaded) as engine, TestClient(create_app(engine, Settings(served_model(loaded, "m")))) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        bad = c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}]}]})
        assert bad.status_code == 400 and "data:video" in bad.json()["error"]["message"]
        r = c.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "video", "source": {"type": "base64", "data": "AAAA"}}]}]})
        assert r.status_code == 400 and "takes no audio or video" in r.json()["error"]["message"]
    model_dir = tmp_path / "chat"
    make_video_chat_model(model_dir)
    out = subprocess.run([sys.executable, "-m", "mlx_mtp.chat", "--model", str(model_dir), "--drafter", str(DRAFTER),
                          "--max-tokens", "2", "--video", str(CLIP), "--prompt", "What happens?"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "goes with your next message" in out.stderr, out.stderr[-2000:]
