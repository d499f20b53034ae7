"""Images through the front end: `Request(messages=...)` with image parts as transformers' chat
templates take them, rendered, expanded, encoded with a lazily loaded tower, and answered as the
same prompt given as ids and placed images; bad images are one-line errors."""

import io

import numpy as np
import pytest
from chat_helpers import DRAFTER, make_vision_chat_model
from PIL import Image

from mlx_mtp import Engine, Request, load
from mlx_mtp.decode.generate import generate_tokens
from mlx_mtp.formats.images import ImageError
from mlx_mtp.models.gemma4_vision import placeholder_runs
from mlx_mtp.formats.vision import encoder

WAIT = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_vision_chat_model(tmp_path_factory.mktemp("vision") / "model")


def picture(w, h, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_the_tower_loads_with_the_first_image_only(model_dir):
    loaded = load(model_dir, DRAFTER)
    assert loaded.vision is not None and not loaded.vision.loaded
    with Engine(loaded) as engine:
        engine.submit(Request(messages=[{"role": "user", "content": "hi"}], max_tokens=3)).result(WAIT)
        assert not loaded.vision.loaded  # text only: never read
        engine.submit(Request(messages=[{"role": "user", "content": [
            {"type": "image", "image": picture(40, 30)}, {"type": "text", "text": "hi"}]}], max_tokens=3)).result(WAIT)
        assert loaded.vision.loaded
    assert load(model_dir, load_vision=True).vision.loaded


def test_image_messages_answer_as_placed_ids(model_dir, tmp_path):
    """Two images (a PIL image and a file path) in one user message: the prompt renders one
    placeholder per image, expanded to each image's soft tokens; the reply (MTP on) equals plain
    decoding of those ids with the images placed."""
    loaded = load(model_dir, DRAFTER)
    assert encoder(loaded).budget == 70  # processor_config.json's
    path = tmp_path / "b.png"
    path.write_bytes(png(picture(30, 45, seed=1)))
    messages = [{"role": "user", "content": [{"type": "image", "image": picture(40, 30)},
                                             {"type": "text", "text": " two pictures "},
                                             {"type": "image", "url": str(path)}]}]
    with Engine(loaded) as engine:
        prepared = engine._prepare.one_shot(Request(messages=messages, max_tokens=20))[1]
        reply = engine.submit(Request(messages=messages, max_tokens=20, draft_tokens=2)).result(WAIT)
    runs = placeholder_runs(prepared.tokens, encoder(loaded).image_token)
    counts = [encoder(loaded).process(s).tokens for s in (picture(40, 30), str(path))]
    assert 1 < counts[0] != counts[1] > 1
    assert [e - s for s, e in runs] == counts
    assert all(prepared.tokens[s - 1] == encoder(loaded).boi and prepared.tokens[e] == encoder(loaded).eoi for s, e in runs)
    plain = [t for t, _ in generate_tokens(loaded.target, prepared.tokens, max_tokens=20, images=prepared.images,
                                           stop_ids=loaded.eos_ids)]
    assert list(reply.tokens) == plain


def test_openai_image_url_parts_and_bytes_are_the_same_image(model_dir):
    import base64

    loaded = load(model_dir)
    data = png(picture(40, 30))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    with Engine(loaded) as engine:
        a = engine._prepare.one_shot(Request(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]}]))[1]
        b = engine._prepare.one_shot(Request(messages=[{"role": "user", "content": [
            {"type": "image", "image": data}, {"type": "text", "text": "x"}]}]))[1]
    assert a.tokens == b.tokens and a.images.digests == b.images.digests


@pytest.mark.parametrize("source, words", [
    (b"GIF89a broken", "not a readable image"),
    ("https://example.com/cat.png", "not fetched"),
    ("data:image/png;base64,AAAA", "not a readable image"),
])
def test_bad_images_are_refused_at_submit(model_dir, source, words):
    with Engine(load(model_dir)) as engine:
        with pytest.raises(ImageError, match=words):
            engine.submit(Request(messages=[{"role": "user", "content": [{"type": "image", "image": source}]}]))


def test_a_model_without_a_tower_says_so():
    from chat_helpers import TINY, make_chat_model  # noqa: F401  (a text-only checkpoint)
    from mlx_mtp.demo import TARGET_DIR

    with Engine(load(TARGET_DIR)) as engine:
        with pytest.raises(ImageError, match="takes no images"):
            engine.submit(Request(messages=[{"role": "user", "content": [{"type": "image", "image": b"x"}]}]))


# ---- the HTTP APIs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def api(model_dir):
    from starlette.testclient import TestClient

    from mlx_mtp.server.app import Settings, create_app, served_model

    loaded = load(model_dir, DRAFTER)
    with Engine(loaded) as engine:
        yield TestClient(create_app(engine, Settings(served_model(loaded, "tiny")))), loaded


def openai_body(image_url, text="what is it?"):
    return {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": text}]}]}


def anthropic_body(data, media="image/png"):
    return {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}},
        {"type": "text", "text": "what is it?"}]}]}


def test_both_apis_answer_an_image_as_the_library_does(api):
    import base64

    client, loaded = api
    data = base64.b64encode(png(picture(40, 30))).decode()
    handle = client.app.state.models.engine.submit(Request(messages=[{"role": "user", "content": [
        {"type": "image", "image": picture(40, 30)}, {"type": "text", "text": "what is it?"}]}], max_tokens=6))
    expected = handle.result(WAIT)
    a = client.post("/v1/chat/completions", json=openai_body("data:image/png;base64," + data)).json()
    b = client.post("/v1/messages", json=anthropic_body(data)).json()
    used = b["usage"]  # Anthropic counts the tokens read from the prefix cache apart
    counted = used["input_tokens"] + used.get("cache_read_input_tokens", 0) + used.get("cache_creation_input_tokens", 0)
    assert a["usage"]["prompt_tokens"] == counted == handle.prompt_tokens > 70
    assert a["usage"]["completion_tokens"] == b["usage"]["output_tokens"] == len(expected.tokens)


@pytest.mark.parametrize("source, words", [
    ("data:image/png;base64,aGVsbG8=", "not a readable image"),  # "hello": not an image
    ("https://example.com/cat.png", "not fetched"),
])
def test_bad_images_are_400s_in_each_apis_words(api, source, words):
    import base64

    client, _ = api
    a = client.post("/v1/chat/completions", json=openai_body(source))
    assert a.status_code == 400 and words in a.json()["error"]["message"]
    assert a.json()["error"]["type"] == "invalid_request_error"
    data = source.split(",", 1)[1] if source.startswith("data:") else base64.b64encode(b"\x00" * 10).decode()
    b = client.post("/v1/messages", json=anthropic_body(data))
    assert b.status_code == 400 and b.json()["type"] == "error"
    assert b.json()["error"]["type"] == "invalid_request_error" and "not a readable image" in b.json()["error"]["message"]


def test_what_is_no_image_type_is_refused_in_each_apis_words(api):
    """A PNG sent as `data:text/plain` (OpenAI takes image types only) or as `image/tiff` (Anthropic
    takes JPEG, PNG, GIF and WebP) is a 400 in that API's own words; as image/png it is taken."""
    import base64

    client, _ = api
    data = base64.b64encode(png(picture(40, 30))).decode()
    a = client.post("/v1/chat/completions", json=openai_body("data:text/plain;base64," + data))
    assert a.status_code == 400 and a.json()["error"] == {
        "message": "Invalid MIME type. Only image types are supported.", "type": "invalid_request_error",
        "param": None, "code": "invalid_image_format"}
    b = client.post("/v1/messages", json=anthropic_body(data, media="image/tiff"))
    assert b.status_code == 400 and b.json() == {"type": "error", "error": {"type": "invalid_request_error",
        "message": "messages.0.content.0.image.source.base64.media_type: Input should be 'image/jpeg', "
                   "'image/png', 'image/gif' or 'image/webp'"}}
    url = "data:image/png;base64," + data
    assert client.post("/v1/chat/completions", json=openai_body(url)).status_code == 200
    assert client.post("/v1/messages", json=anthropic_body(data)).status_code == 200


def test_openai_says_which_parts_a_message_takes():
    from mlx_mtp.server import protocol
    from mlx_mtp.server.common import APIError, ServedModel

    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    file = {"type": "file", "file": {"file_id": "f"}}
    for role, part, parts in (("user", file, "text, image_url, input_audio and video_url parts"),
                              ("assistant", audio, "text parts")):
        with pytest.raises(APIError) as e:
            protocol.parse_chat({"messages": [{"role": role, "content": [part]}]}, ServedModel("m", 64, 128))
        assert str(e.value) == f"messages[0].content must be a string or a list of {parts}"


def test_count_tokens_counts_soft_tokens(api):
    import base64

    client, loaded = api
    body = anthropic_body(base64.b64encode(png(picture(30, 45))).decode())
    counted = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    request = Request(messages=[{"role": "user", "content": [{"type": "image", "image": picture(30, 45)},
                                                             {"type": "text", "text": "what is it?"}]}])
    assert counted == len(client.app.state.models.engine._prepare.one_shot(request)[1].tokens) > 60


# ---- the chat -----------------------------------------------------------------------------------

def test_chat_shows_images_with_a_message(model_dir, tmp_path):
    """`--image PATH` goes with --prompt; `/image PATH` with the next message; a second image in the
    next turn joins the conversation so far. The printed reply is the library's for the same messages."""
    import subprocess
    import sys

    first, second = tmp_path / "a.png", tmp_path / "b.png"
    first.write_bytes(png(picture(40, 30)))
    second.write_bytes(png(picture(30, 45, seed=1)))
    run = subprocess.run([sys.executable, "-m", "mlx_mtp.chat", "--model", str(model_dir), "--drafter", str(DRAFTER),
                          "--max-tokens", "5"], input=f"/image {first}\nwhat is it?\n/image {second}\nand this?\n"
                         f"/image {tmp_path}/missing.png\n".encode(), capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode()
    err = run.stderr.decode()
    assert err.count("goes with your next message") == 2 and "no image file" in err
    loaded = load(model_dir, DRAFTER)
    with Engine(loaded) as engine:
        messages = [{"role": "user", "content": [{"type": "image", "image": str(first)},
                                                 {"type": "text", "text": "what is it?"}]}]
        reply = engine.submit(Request(messages=messages, max_tokens=5)).result(WAIT)
    assert run.stdout.decode().startswith(reply.text)


def test_chat_image_flag_goes_with_the_prompt(model_dir, tmp_path, capsys):
    from mlx_mtp import chat

    path = tmp_path / "a.png"
    path.write_bytes(png(picture(40, 30)))
    assert chat.main(["--model", str(model_dir), "--max-tokens", "5", "--image", str(path), "--prompt", "what?"]) == 0
    assert "goes with your next message" in capsys.readouterr().err
    assert chat.main(["--model", str(model_dir), "--image", str(tmp_path / "none.png"), "--prompt", "x"]) == 2
    assert chat.main(["--model", str(model_dir), "--raw", "--image", str(path), "--prompt", "x"]) == 2
    assert "images go with chat messages" in capsys.readouterr().err


def test_image_chat_reuses_the_turns_before(model_dir):
    """The second turn of a chat with an image restores the first turn (its image by content) from the
    prefix cache instead of prefilling it again."""
    from mlx_mtp.chat_images import ImageChat

    with Engine(load(model_dir, DRAFTER)) as engine:
        chat = ImageChat(engine)
        list(chat.reply("what is it?", max_tokens=4, images=[picture(40, 30)]))
        first = len(chat.tokens)
        assert chat.cached_tokens() >= first - 1  # the image's placeholders keyed by its content
        list(chat.reply("and now?", max_tokens=4))
        assert chat.last_stats.cached_tokens >= first - 8  # up to where the template re-renders the reply
        assert chat.messages[-1]["role"] == "assistant" and len(chat.messages) == 4


def test_http_image_urls_are_fetched_only_when_allowed(api, tmp_path):
    """--allow-image-urls (VisionEncoder.fetch_urls): an http URL's bytes are the image; off, a 400."""
    import functools
    import http.server
    import threading

    (tmp_path / "a.png").write_bytes(png(picture(40, 30)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client, loaded = api
    url = f"http://127.0.0.1:{server.server_address[1]}/a.png"
    try:
        assert client.post("/v1/chat/completions", json=openai_body(url)).status_code == 400
        encoder(loaded).fetch_urls = True
        ok = client.post("/v1/chat/completions", json=openai_body(url))
        missing = client.post("/v1/chat/completions", json=openai_body(url.replace("a.png", "b.png")))
    finally:
        encoder(loaded).fetch_urls = False
        server.shutdown()
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > 60
    assert missing.status_code == 400 and "cannot fetch the image" in missing.json()["error"]["message"]


def test_a_part_may_ask_for_its_budget():
    from mlx_mtp.formats.media import message_media
    from mlx_mtp.formats.vision import ImagePart

    sources, messages = message_media([{"role": "user", "content": [
        {"type": "image", "image": b"a", "max_soft_tokens": 560},
        {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "data:y", "detail": "high"}}, {"type": "text", "text": "hi"}]}])
    assert sources == [ImagePart(b"a", 560), ImagePart("data:x", 70), ImagePart("data:y", None)]
    assert messages[0]["content"] == [{"type": "image"}] * 3 + [{"type": "text", "text": "hi"}]
    with pytest.raises(ImageError, match="max_soft_tokens must be one of"):
        message_media([{"role": "user", "content": [{"type": "image", "image": b"a", "max_soft_tokens": 100}]}])
