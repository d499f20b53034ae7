"""Generate the video fixtures: frame sampling, timestamps and prompts of transformers' Gemma 4 video
processors, its default decoder's reading of a few small clips, and the resize difference.

Ground truth is transformers==5.23.0 with torch 2.14.1, torchvision 0.29.1, PyAV and torchcodec
(transformers' default video decoder, which needs FFmpeg's shared libraries: Debian's libavcodec59,
libavformat59, libavfilter8, libswscale6, libswresample4, libavutil57, libavdevice59). Usage:

    python3.11 -m venv /tmp/ref-venv-video
    /tmp/ref-venv-video/bin/pip install transformers==5.23.0 torch==2.14.1 torchvision==0.29.1 av torchcodec
    /tmp/ref-venv-video/bin/python tests/reference/make_video_fixtures.py [--out tests/fixtures/video]

It writes under <out>:

* ``clip.mp4``: the test clip, ``write_clip(CLIP)`` (H.264, 48 frames of 32x24 at 24 fps, 2 s, 24 KB;
  frame i has its left half at grey level 5 i). libx264 in PyAV's wheel writes the same bytes for the same
  PyAV version; a new version may write other bytes, and everything below is then read from them.
* ``video.json``:
  - ``sampling``: for T in TOTALS and each fps in RATES, what ``Gemma4VideoProcessor`` (the released
    config: 32 frames, 70 soft tokens) and ``Gemma4UnifiedVideoProcessor`` give for T frames of
    336x480 (70 soft tokens) with ``VideoMetadata(total_num_frames=T, fps=fps)``: ``indices``,
    ``timestamps`` (``mm:ss``, as ``replace_video_token`` writes them), ``tokens`` (soft tokens per
    frame) and the sha256 of the text one ``<|video|>`` becomes (``replace_video_token``, the same
    for both processors, which the script asserts); or the ``error`` transformers raised (T = 31).
    ``sample_fps`` cases are processors made with ``num_frames=None, fps=...``: the only way 5.23
    samples by rate (with the released config a per-call ``fps=`` is ignored: 32 frames).
  - ``tokens``: soft tokens per frame for frames of each size in SIZES, from both processors.
  - ``clip``: the processor run on the clip's path end to end (torchcodec decodes it): T, fps,
    ``indices``, ``timestamps``, the sha256 of each sampled frame's RGB bytes as torchcodec decodes
    it and its left half's mean, and for each chat template in TEMPLATES the rendered ``text``
    (``apply_chat_template``, a video and a question), the sha256 of the text the processor
    tokenizes (``expanded_sha256``) and its ``ids``: the tests' character tokenizer
    (``chat_helpers.all_controls_vocab``: ``<|image>`` 120, ``<image|>`` 122, ``<|video|>`` 126)
    stands in for Gemma 4's.
  - ``containers``: for each recipe in CONTAINERS (made with ``write_clip``), torchcodec's
    ``num_frames`` and ``average_fps`` in exact mode, and the header's frame count and rate, which
    transformers' ``read_video_pyav`` would take instead.
  - ``rotation``: for each display rotation in ROTATIONS, the shape of torchcodec's frame and the
    corner the clip's white top-left square ends in.
  - ``resize``: on the clip's 32 sampled frames (32x24 up to 432x336) and on RESIZE_CLIP's (640x480
    down to 432x336), how many of the uint8 values of ``Gemma4VideoProcessor``'s
    ``pixel_values_videos`` (torchvision's antialiased bicubic; x 255, rounded) differ from
    ``mlx_mtp.formats.images.process`` at budget 70 on the same decoded frames (Pillow's bicubic),
    and by how much at most. The script asserts that the float32 values are the image path's
    rescale table (``images._RESCALE``) at torchvision's codes: only the resize differs.
  - ``versions``: the libraries and the machine.

Deterministic (blank frames and formulas; no model is run). About 25 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
TOTALS = (31, 32, 33, 300, 7200)
RATES = (24.0, 30.0, 30000 / 1001, 1.0)
SAMPLE_FPS = ((300, 30.0, 1.0), (300, 30.0, 2.0), (300, 30.0, 0.05), (300, 30.0, 60.0), (90, 29.97, 2.5))
SIZES = ((24, 32), (336, 480), (480, 640), (720, 1280), (1080, 1920), (640, 480), (500, 500), (10, 1000))
TEMPLATES = {  # the E2B/E4B and the 26B/31B/12B families (tests/fixtures/real_configs/SOURCES.md)
    "e2b-2026-04-13": "real_configs/google--gemma-4-E2B-it/chat_template.jinja",
    "large-2026-07-14": "chat_templates/gemma4-large-2026-07-14.jinja",
}
CLIP = {"container": "mp4", "codec": "libx264", "rate": "24", "frames": 48, "width": 32, "height": 24,
        "crf": 8}
RESIZE_CLIP = {"container": "mkv", "codec": "libx264", "rate": "25", "frames": 33, "width": 640,
               "height": 480, "crf": 10}
CONTAINERS = {
    "mkv_29.97": {"container": "mkv", "codec": "libx264", "rate": "30000/1001", "frames": 60},
    "webm_25": {"container": "webm", "codec": "libvpx-vp9", "rate": "25", "frames": 40},
    "avi_29.97": {"container": "avi", "codec": "mpeg4", "rate": "30000/1001", "frames": 60},
    "mkv_variable": {"container": "mkv", "codec": "libx264", "rate": "30", "frames": 50,
                     "time_base": "1/1000", "pts": [1000 + 37 * i + (i * i) % 11 for i in range(50)]},
    "gif_10": {"container": "gif", "codec": "gif", "rate": "10", "frames": 12, "pix_fmt": "rgb8"},
}
ROTATIONS = (90, -90, 180)


def write_clip(path, recipe: dict) -> None:
    """A small clip made with PyAV from a recipe: `container`, `codec`, `rate` ("num/den" frames a
    second), `frames`, `width`/`height` (32x24), and optionally `pts` in `time_base`, `rotation`
    (degrees, counter-clockwise, as a display matrix), `crf`, `pix_fmt`. Frame i's left half is grey
    level 5 i (mod 256) but for a white 8x8 square at the top left, its right half a texture that
    changes every frame. Also used by tests/test_video.py to make the clips it does not commit."""
    import av

    width, height = recipe.get("width", 32), recipe.get("height", 24)
    container = {"mkv": "matroska"}.get(recipe["container"], recipe["container"])
    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(recipe["codec"], rate=Fraction(recipe["rate"]))
        stream.width, stream.height = width, height
        stream.pix_fmt = recipe.get("pix_fmt", "yuv420p")
        options = {"threads": "1"} if recipe["codec"] == "libx264" else {}
        if "crf" in recipe:
            options["crf"] = str(recipe["crf"])
        stream.options = options
        if "rotation" in recipe:
            stream.set_display_rotation(recipe["rotation"])
        base = Fraction(recipe["time_base"]) if "time_base" in recipe else None
        if base:
            stream.codec_context.time_base = base
        out.start_encoding()  # the header, even with no frame (a clip of 0 frames)
        y, x = np.mgrid[:height, :width]
        for i in range(recipe["frames"]):
            rgb = np.empty((height, width, 3), np.uint8)
            rgb[:, : width // 2] = 5 * i % 256
            for c in range(3):
                texture = (x * 37 + y * 91 + (x + i) * (y + 7) * (c + 3)) % 256
                rgb[:, width // 2:, c] = texture[:, width // 2:]
            rgb[:8, :8] = 255
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            if base:
                frame.pts, frame.time_base = recipe["pts"][i], base
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def stamps(meta) -> list:
    """The timestamps `replace_video_token` writes for a video's metadata."""
    return [f"{int(s // 60):02d}:{int(s % 60):02d}" for s in meta.timestamps]


def sha256(data) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else bytes(data)).hexdigest()


def tokenizer_dir(path: Path) -> Path:
    """The tests' character tokenizer with Gemma 4's control and media tokens, and the token names
    Gemma4Processor reads from a tokenizer config."""
    sys.path.insert(0, str(TESTS))
    import chat_helpers

    chat_helpers.write_gemma4_tokenizer(path, None, chat_helpers.all_controls_vocab())
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(image_token="<|image|>", boi_token="<|image>", eoi_token="<image|>",
                  audio_token="<|audio|>", boa_token="<|audio>", eoa_token="<audio|>",
                  extra_special_tokens=["<|video|>"])
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def processors(tokenizer_path: Path, template: str | None = None) -> dict:
    from transformers import (
        AutoTokenizer,
        Gemma4AudioFeatureExtractor,
        Gemma4Processor,
        Gemma4UnifiedProcessor,
        Gemma4UnifiedVideoProcessor,
        Gemma4VideoProcessor,
    )
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )
    from transformers.models.gemma4_unified.image_processing_gemma4_unified import Gemma4UnifiedImageProcessor

    def tokenizer():
        return AutoTokenizer.from_pretrained(tokenizer_path)

    return {
        "gemma4": Gemma4Processor(Gemma4AudioFeatureExtractor(), Gemma4ImageProcessorPil(), tokenizer(),
                                  Gemma4VideoProcessor(), chat_template=template),
        "gemma4_unified": Gemma4UnifiedProcessor(Gemma4UnifiedAudioFeatureExtractor(),
                                                 Gemma4UnifiedImageProcessor(), tokenizer(),
                                                 Gemma4UnifiedVideoProcessor(), chat_template=template),
    }


def sample_case(procs: dict, total: int, fps: float, height: int = 336, width: int = 480,
                config: dict | None = None) -> dict:
    """What both video processors make of `total` blank frames at `fps`; `config` builds the video
    processors anew (num_frames=None, fps=... for sampling by rate)."""
    from transformers.video_utils import VideoMetadata

    frames = np.broadcast_to(np.zeros((1, height, width, 3), np.uint8), (total, height, width, 3))
    found = {}
    for kind, proc in procs.items():
        video_processor = type(proc.video_processor)(**config) if config else proc.video_processor
        try:
            meta = VideoMetadata(total_num_frames=total, fps=fps)
            out = video_processor(videos=[frames], video_metadata=[meta], return_metadata=True,
                                  return_tensors="np")
        except ValueError as e:
            found[kind] = {"error": str(e)}
            continue
        meta = out["video_metadata"][0]
        text = proc.replace_video_token(out, 0)
        found[kind] = {"indices": [int(i) for i in meta.frames_indices], "timestamps": stamps(meta),
                       "tokens": int(out["num_soft_tokens_per_video"][0]), "text_sha256": sha256(text)}
    assert found["gemma4"] == found["gemma4_unified"], (total, fps, config)
    return found["gemma4"]


def clip_case(procs_by_template: dict, clip: Path) -> dict:
    """The processors on the clip's path: torchcodec decodes, the processor samples, and the chat."""
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(str(clip), seek_mode="exact")
    found, chats = None, {}
    for name, procs in procs_by_template.items():
        for kind, proc in procs.items():
            messages = [{"role": "user", "content": [{"type": "video", "video": str(clip)},
                                                     {"type": "text", "text": "What happens?"}]}]
            text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            out = proc.video_processor(videos=[str(clip)], return_metadata=True, return_tensors="np")
            meta = out["video_metadata"][0]
            expanded = text.replace("<|video|>", proc.replace_video_token(out, 0), 1)
            ids = proc(text=[text], videos=[str(clip)], return_tensors="np")["input_ids"][0].tolist()
            assert proc.tokenizer.decode(ids) == expanded, (name, kind)
            chat = {"text": text, "expanded_sha256": sha256(expanded), "ids": ids}
            assert chats.setdefault(name, chat) == chat, (name, kind)
            indices = [int(i) for i in meta.frames_indices]
            case = {"total": int(meta.total_num_frames), "fps": float(meta.fps), "indices": indices,
                    "timestamps": stamps(meta), "tokens": int(out["num_soft_tokens_per_video"][0])}
            assert found is None or found == case, kind
            found = case
    frames = decoder.get_frames_at(indices=found["indices"]).data.permute(0, 2, 3, 1).numpy()
    found["frame_sha256"] = [sha256(np.ascontiguousarray(f).tobytes()) for f in frames]
    found["left_mean"] = [round(float(f[8:, : f.shape[1] // 2 - 2].mean()), 3) for f in frames]
    return {**found, "chats": chats}


def container_case(recipe: dict, workdir: Path) -> dict:
    import av
    from torchcodec.decoders import VideoDecoder

    path = workdir / f"clip.{recipe['container']}"
    write_clip(path, recipe)
    meta = VideoDecoder(str(path), seek_mode="exact").metadata
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        header = {"frames": int(stream.frames), "average_rate": str(stream.average_rate)}
    return {"recipe": recipe, "num_frames": int(meta.num_frames), "average_fps": float(meta.average_fps),
            "header": header}


def rotation_case(degrees: int, workdir: Path) -> dict:
    from torchcodec.decoders import VideoDecoder

    recipe = {**CLIP, "frames": 4, "rotation": degrees}
    path = workdir / f"rot{degrees}.mp4"
    write_clip(path, recipe)
    frame = VideoDecoder(str(path), seek_mode="exact")[0].permute(1, 2, 0).numpy()
    corners = {"top-left": frame[:4, :4], "top-right": frame[:4, -4:], "bottom-left": frame[-4:, :4],
               "bottom-right": frame[-4:, -4:]}
    white = [name for name, block in corners.items() if block.mean() > 200]
    assert len(white) == 1, (degrees, white)
    return {"recipe": recipe, "shape": list(frame.shape), "white": white[0]}


def resize_case(path: Path) -> dict:
    """torchvision (the video processor) against Pillow (mlx_mtp's image path) on the same frames."""
    import importlib.util

    from torchcodec.decoders import VideoDecoder
    from transformers import Gemma4VideoProcessor

    spec = importlib.util.spec_from_file_location("images", ROOT / "mlx_mtp" / "formats" / "images.py")
    images = sys.modules["images"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(images)  # numpy and Pillow only: no MLX in this venv
    from PIL import Image

    out = Gemma4VideoProcessor()(videos=[str(path)], return_tensors="np")
    torch_codes = np.rint(out["pixel_values_videos"] * 255).astype(np.int16)
    # the rescale is the image path's table, exactly: only the resize differs
    assert np.array_equal(out["pixel_values_videos"], images._RESCALE[torch_codes])
    decoder = VideoDecoder(str(path), seek_mode="exact")
    indices = np.arange(32) * decoder.metadata.num_frames // 32
    frames = decoder.get_frames_at(indices=indices).data.permute(0, 2, 3, 1).numpy()
    differ, largest, values = 0, 0, 0
    for k, frame in enumerate(frames):
        ours = images.process(Image.fromarray(frame), budget=70)
        mine = np.rint(ours.pixels * 255).astype(np.int16)
        theirs = torch_codes[k, : len(mine)]
        differ += int((mine != theirs).sum())
        largest = max(largest, int(np.abs(mine - theirs).max()))
        values += mine.size
    h, w = frames.shape[1:3]
    target = images.target_size(h, w, 70)
    return {"frames": len(frames), "from": f"{w}x{h}", "to": f"{target[1]}x{target[0]}",
            "values": values, "differ": differ, "fraction": differ / values, "max_lsb": largest}


def dump(fixture: dict) -> str:
    """JSON with one item a line, but a list of numbers or short strings on one line."""
    text = json.dumps(fixture, indent=1)
    leaf = re.compile(r"\[\n\s*([-\w.\":, \n]*?)\n\s*\]")  # a list with no list or object in it
    text = leaf.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text)
    assert json.loads(text) == fixture
    return text + "\n"


def versions() -> dict:
    import av
    import torch
    import torchcodec
    import torchvision
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "torchvision": torchvision.__version__, "torchcodec": torchcodec.__version__,
            "av": av.__version__, "pyav_ffmpeg": str(av.ffmpeg_version_info), "numpy": np.__version__,
            "machine": platform.machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TESTS / "fixtures" / "video")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    write_clip(out / "clip.mp4", CLIP)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        tokenizer = tokenizer_dir(workdir / "tokenizer")
        procs = processors(tokenizer)
        sampling = [{"total": t, "fps": fps, **sample_case(procs, t, fps)} for t in TOTALS for fps in RATES]
        sampling += [{"total": t, "fps": fps, "sample_fps": rate,
                      **sample_case(procs, t, fps, config={"num_frames": None, "fps": rate})}
                     for t, fps, rate in SAMPLE_FPS]
        tokens = [{"height": h, "width": w, "tokens": sample_case(procs, 32, 30.0, h, w)["tokens"]}
                  for h, w in SIZES]
        by_template = {name: processors(tokenizer, (TESTS / "fixtures" / path).read_text())
                       for name, path in TEMPLATES.items()}
        clip = clip_case(by_template, out / "clip.mp4")
        containers = {name: container_case(recipe, workdir) for name, recipe in CONTAINERS.items()}
        rotation = {str(d): rotation_case(d, workdir) for d in ROTATIONS}
        write_clip(workdir / "resize.mkv", RESIZE_CLIP)
        resize = {"clip": resize_case(out / "clip.mp4"),
                  "resize_clip": {**resize_case(workdir / "resize.mkv"), "recipe": RESIZE_CLIP}}
    fixture = {"sampling": sampling, "tokens": tokens, "clip": {"recipe": CLIP, **clip},
               "containers": containers, "rotation": rotation, "resize": resize, "versions": versions()}
    (out / "video.json").write_text(dump(fixture))
    print(f"wrote {out}: clip.mp4 ({(out / 'clip.mp4').stat().st_size} bytes), video.json; resize:",
          json.dumps(resize))


if __name__ == "__main__":
    main()
