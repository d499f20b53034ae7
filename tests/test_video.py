"""Video in (mlx_mtp.formats.video): frame sampling, timestamps and prompt text against transformers
5.23's Gemma 4 video processors, decoding against torchcodec, its default decoder
(tests/fixtures/video, made by tests/reference/make_video_fixtures.py), and the errors. The decoding
tests need PyAV (the `video` extra, which the `test` extra includes) and skip without it."""

import base64
import hashlib
import importlib.util
import io
import json
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from chat_helpers import all_controls_vocab

from mlx_mtp.formats import images, video
from mlx_mtp.formats.video import VideoError, from_frames, load_video, prompt_text, sample_indices, timestamp

FIXTURES = Path(__file__).parent / "fixtures" / "video"
CLIP = FIXTURES / "clip.mp4"


def has_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


needs_av = pytest.mark.skipif(not has_pyav(), reason="PyAV is not installed (pip install 'mlx-mtp[video]')")


@cache
def fixture() -> dict:
    return json.loads((FIXTURES / "video.json").read_text())


@cache
def recipes():
    """make_video_fixtures.py as a module: its write_clip makes the clips the tests do not commit."""
    script = Path(__file__).parent / "reference" / "make_video_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_video_fixtures", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message, message
    return message


# ---- sampling, timestamps and the prompt: transformers' numbers, no decoding ----------------------

@pytest.mark.parametrize("case", fixture()["sampling"], ids=lambda c: f"T{c['total']}-fps{c['fps']:.3f}"
                         + (f"-sample{c['sample_fps']}" if "sample_fps" in c else ""))
def test_sampling_timestamps_and_prompt_match_transformers(case):
    total, fps, rate = case["total"], case["fps"], case.get("sample_fps")
    indices = sample_indices(total, fps, None if rate else 32, rate)
    if "error" in case:  # transformers refuses a clip shorter than what it samples; we take every frame
        assert "exceeds total_num_frames" in case["error"]
        assert indices.tolist() == list(range(total))
        return
    assert indices.dtype == np.int64 and indices.tolist() == case["indices"]
    stamps = [timestamp(int(i) / fps) for i in indices]
    assert stamps == case["timestamps"]
    assert images.soft_tokens(336, 480, 70) == case["tokens"] == 70
    assert sha256(prompt_text(stamps, case["tokens"])) == case["text_sha256"]


def test_a_sampled_clip_gives_the_same_prompt_through_from_frames():
    case = next(c for c in fixture()["sampling"] if c["total"] == 300 and c["fps"] == 30.0)
    clip = from_frames(np.zeros((300, 336, 480, 3), np.uint8), 30.0)
    assert clip.indices.tolist() == case["indices"] and clip.total == 300 and clip.fps == 30.0
    assert clip.frames.shape == (32, 336, 480, 3) and clip.tokens() == 70
    assert clip.timestamps == case["timestamps"]
    assert sha256(clip.prompt()) == case["text_sha256"]


@pytest.mark.parametrize("case", fixture()["tokens"], ids=lambda c: f"{c['width']}x{c['height']}")
def test_soft_tokens_per_frame_match_both_processors(case):
    clip = from_frames(np.zeros((1, case["height"], case["width"], 3), np.uint8), 24.0)
    assert clip.tokens() == case["tokens"]
    assert images.process(clip.images()[0], budget=70).tokens == case["tokens"]


def test_timestamps_are_truncated_minutes_and_seconds():
    assert [timestamp(s) for s in (0, 0.999, 1, 59.999, 60, 61.9, 3599.99, 3600, 3665.5, 7199)] == [
        "00:00", "00:00", "00:01", "00:59", "01:00", "01:01", "59:59", "60:00", "61:05", "119:59"]


def test_prompt_text_is_one_block_per_frame_joined_by_spaces():
    assert prompt_text(["00:00", "00:01"], 2) == (
        "00:00 <|image><|video|><|video|><image|> 00:01 <|image><|video|><|video|><image|>")
    assert prompt_text([], 70) == ""


def test_sampling_by_rate_and_short_clips():
    assert sample_indices(300, 30.0, None, 1.0).tolist() == list(range(0, 300, 30))
    assert sample_indices(300, 30.0, None, 0.05).tolist() == [0]
    assert sample_indices(300, 30.0, None, 60.0).tolist() == list(range(300))  # transformers raises
    assert sample_indices(1, 24.0).tolist() == [0]
    assert sample_indices(31, 24.0, 8).tolist() == [0, 3, 7, 11, 15, 19, 23, 27]


@pytest.mark.parametrize("args, match", [
    ((300, 30.0, None, None), "one of the two"),
    ((300, 30.0, 32, 1.0), "one of the two"),
    ((300, 0.0), "fps must be a positive number, not 0.0"),
    ((300, None), "fps must be a positive number, not None"),
    ((300, float("nan")), "fps must be a positive number"),
    ((0, 30.0), "holds no frames"),
    ((300, 30.0, 0), "num_frames must be a whole number of at least 1, not 0"),
    ((300, 30.0, 2.5), "num_frames must be a whole number"),
    ((300, 30.0, True), "num_frames must be a whole number"),
    ((300, 30.0, None, -1.0), "sample_fps must be a positive number"),
])
def test_bad_sampling_arguments_are_one_line_errors(args, match):
    with pytest.raises(VideoError, match=match) as excinfo:
        sample_indices(*args)
    one_line(excinfo)


@pytest.mark.parametrize("frames, fps, match", [
    (np.zeros((4, 24, 32), np.uint8), 24.0, r"\(frames, height, width, 3\) uint8 RGB array, not uint8 \(4,"),
    (np.zeros((4, 24, 32, 3), np.float32), 24.0, "not float32"),
    ([np.zeros((24, 32, 3), np.uint8)], 24.0, "not list"),
    (np.zeros((4, 0, 32, 3), np.uint8), 24.0, "frames are 32x0 pixels: empty"),
    (np.zeros((0, 24, 32, 3), np.uint8), 24.0, "holds no frames"),
    (np.zeros((4, 24, 32, 3), np.uint8), None, "fps must be a positive number"),
])
def test_bad_frame_arrays_are_one_line_errors(frames, fps, match):
    with pytest.raises(VideoError, match=match) as excinfo:
        from_frames(frames, fps)
    one_line(excinfo)


def test_a_frame_budget_outside_the_image_budgets_is_refused():
    clip = from_frames(np.zeros((2, 24, 32, 3), np.uint8), 24.0)
    assert clip.tokens(280) == images.soft_tokens(24, 32, 280)
    with pytest.raises(VideoError, match="budget must be one of 70, 140, 280, 560, 1120, not 100") as excinfo:
        clip.prompt(100)
    one_line(excinfo)


@pytest.mark.parametrize("name", ["e2b-2026-04-13", "large-2026-07-14"])
def test_the_chat_prompt_ids_match_the_processors(name):
    """The template's `<|video|>` replaced by our text, in the tests' character tokenizer, is the
    processors' input_ids for the clip (both processors, rendered by both template families)."""
    clip, chat = fixture()["clip"], fixture()["clip"]["chats"][name]
    expanded = chat["text"].replace("<|video|>", prompt_text(clip["timestamps"], clip["tokens"]), 1)
    assert sha256(expanded) == chat["expanded_sha256"]
    token = {i: t for t, i in all_controls_vocab().items()}
    assert "".join(token[i] for i in chat["ids"]) == expanded
    assert chat["ids"].count(126) == 32 * 63 and chat["ids"].count(120) == chat["ids"].count(122) == 32


# ---- decoding -------------------------------------------------------------------------------------

@needs_av
def test_the_clip_decodes_as_transformers_decodes_it():
    ref = fixture()["clip"]
    clip = load_video(CLIP)
    assert (clip.total, clip.fps) == (ref["total"], ref["fps"]) == (48, 24.0)
    assert clip.indices.tolist() == ref["indices"] and clip.timestamps == ref["timestamps"]
    assert clip.frames.shape == (32, 24, 32, 3) and clip.frames.dtype == np.uint8
    assert [hashlib.sha256(f.tobytes()).hexdigest() for f in clip.frames] == ref["frame_sha256"], \
        "PyAV's frames differ from torchcodec's (another FFmpeg's YUV to RGB?)"
    levels = clip.frames[:, 8:, :14].mean(axis=(1, 2, 3))  # frame i's left half is grey level 5 i
    assert np.abs(levels - 5 * clip.indices).max() <= 1.5
    assert clip.tokens() == ref["tokens"] == 63
    for chat in ref["chats"].values():  # the processors' whole prompt, from our decoding
        assert sha256(chat["text"].replace("<|video|>", clip.prompt(), 1)) == chat["expanded_sha256"]


@needs_av
def test_bytes_data_urls_and_paths_decode_alike():
    data = CLIP.read_bytes()
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    clips = [load_video(CLIP), load_video(str(CLIP)), load_video(data), load_video(bytearray(data)),
             load_video(memoryview(data)), load_video(url)]
    for clip in clips[1:]:
        assert np.array_equal(clip.frames, clips[0].frames) and clip.fps == clips[0].fps


@needs_av
def test_frames_go_through_the_image_path():
    clip = load_video(CLIP, num_frames=4)
    assert clip.indices.tolist() == [0, 12, 24, 36]
    assert clip.timestamps == ["00:00", "00:00", "00:01", "00:01"]
    pictures = clip.images()
    assert [p.size for p in pictures] == [(32, 24)] * 4
    patches = [images.process(p, budget=70) for p in pictures]
    assert {p.tokens for p in patches} == {clip.tokens()} == {63}
    assert patches[0].pixels.shape == (63 * 9, 16 * 16 * 3)
    assert load_video(CLIP, num_frames=None, sample_fps=2.0).indices.tolist() == list(range(0, 48, 12))
    assert load_video(CLIP, num_frames=100).indices.tolist() == list(range(48))  # every frame of a short clip


@needs_av
@pytest.mark.parametrize("name", sorted(fixture()["containers"]))
def test_frame_count_and_rate_match_torchcodec(name, tmp_path):
    case = fixture()["containers"][name]
    path = tmp_path / f"clip.{case['recipe']['container']}"
    recipes().write_clip(path, case["recipe"])
    clip = load_video(path)
    assert (clip.total, clip.fps) == (case["num_frames"], case["average_fps"])


@needs_av
@pytest.mark.parametrize("degrees", sorted(fixture()["rotation"]))
def test_rotated_clips_come_out_upright_as_torchcodec_turns_them(degrees, tmp_path):
    case = fixture()["rotation"][degrees]
    recipes().write_clip(tmp_path / "clip.mp4", case["recipe"])
    frame = load_video(tmp_path / "clip.mp4").frames[0]
    assert list(frame.shape) == case["shape"]
    corners = {"top-left": frame[:4, :4], "top-right": frame[:4, -4:], "bottom-left": frame[-4:, :4],
               "bottom-right": frame[-4:, -4:]}
    assert [name for name, block in corners.items() if block.mean() > 200] == [case["white"]]


# ---- errors, each one line --------------------------------------------------------------------------

def png_bytes() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def wav_bytes() -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1600), np.int16), format="s16", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    return buffer.getvalue()


def mangled(how: str) -> bytes:
    data = CLIP.read_bytes()
    return {"half": data[: len(data) // 2], "tail": data[:-100],
            "middle": data[:3000] + bytes(range(256)) * 32 + data[11192:]}[how]


@needs_av
@pytest.mark.parametrize("source, match", [
    (lambda: b"hello, this is not a video at all\n" * 20, "the video file is not a video FFmpeg can read"),
    (lambda: b"", "the video file is empty"),
    (lambda: mangled("half"), "the video file is not a video FFmpeg can read"),
    (lambda: mangled("tail"), r"the video file holds no video frames \(empty or truncated\)"),
    (lambda: mangled("middle"), "the video file is corrupt or truncated"),
    (png_bytes, r"the video file is a still image \(png\), not a video: send it as an image"),
    (wav_bytes, r"the video file has no video stream \(it holds audio\)"),
    (lambda: "/no/such/clip.mp4", "no video file at /no/such/clip.mp4"),
    (lambda: "https://example.com/clip.mp4", "video URLs are not fetched"),
    (lambda: "data:image/png;base64,AAAA", "media type must be video/..., not image/png"),
    (lambda: "data:video/mp4;base64,***", "not valid base64"),
    (lambda: "data:video/mp4,AAAA", "must be data:<media type>;base64,<data>"),
    (lambda: 42, "a video is a path, bytes or a data URL, not int"),
])
def test_bad_videos_are_one_line_errors(source, match):
    with pytest.raises(VideoError, match=match) as excinfo:
        load_video(source())
    one_line(excinfo)


@needs_av
@pytest.mark.parametrize("container, match", [("mkv", r"not a video FFmpeg can read \(End of file\)"),
                                              ("mp4", r"has no video stream \(it holds nothing\)")])
def test_a_clip_of_no_frames_is_refused(container, match, tmp_path):
    """FFmpeg finds no video stream in such a file; one whose index is cut off holds no frames (above)."""
    path = tmp_path / f"empty.{container}"
    recipes().write_clip(path, {"container": container, "codec": "libx264", "rate": "24", "frames": 0})
    with pytest.raises(VideoError, match=match) as excinfo:
        load_video(path)
    one_line(excinfo)


@needs_av
@pytest.mark.parametrize("limit, value, match", [
    ("MAX_SECONDS", 1, "is longer than 1 s or 36,000 frames: a video is taken up to that"),
    ("MAX_FRAMES", 40, "is longer than 600 s or 40 frames"),
    ("MAX_PIXELS", 32 * 23, r"frames are 32x24 pixels; a frame is taken up to 0.0 MP"),
    ("MAX_SAMPLED_BYTES", 32 * 24 * 3 * 31, "32 frames of 32x24 take over .* GiB: sample fewer frames"),
])
def test_clips_over_the_limits_are_refused(monkeypatch, limit, value, match):
    monkeypatch.setattr(video, limit, value)
    with pytest.raises(VideoError, match=match) as excinfo:
        load_video(CLIP)
    one_line(excinfo)


def test_without_pyav_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(VideoError) as excinfo:
        load_video(CLIP)
    assert one_line(excinfo) == "video needs PyAV: pip install 'mlx-mtp[video]'"
