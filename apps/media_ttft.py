"""Time to first token with 10 s of audio or a 16-frame video (issue 50), and the encoders alone at
real shapes.

    python -m apps.media_ttft [--shapes tiny,e4b,12b,video-tiny,video-e4b] [--seconds 10] [--frames 16]
                              [--repeats 3] [--warmup 1] [--peer mlx-vlm]

`tiny`: the tests' tiny E2B-shaped chat checkpoint with an audio tower (tests/chat_helpers.py
`make_audio_chat_model`: the tiny E2B target, a conformer of tests/fixtures/audio_tower's shape,
random weights) and its MTP drafter: from `Engine.submit` of a chat request holding the clip to its
first token, a new clip each time (prefix cache off): decoding, log-mel, encoding, prefill and the
first token; and the same request without the clip, for comparison.
`e4b`: the released E2B/E4B audio tower's shape (12 conformer layers at width 1024, 305M parameters,
projected to E4B's text width 2560), random weights in float32: log-mel and the encoder
(`Audio.soft_tokens`, evaluated) of one clip; the language model's prefill of its 250 soft tokens
comes on top. `12b`: the 12B's audio embedder (640-sample frames, projected to 3840): framing and
the embedder. `video-tiny`: the tests' tiny vision chat checkpoint (tests/fixtures/vision/bidir,
26B/31B-like, with `<|video|>`): TTFT of a chat request holding a video of `--frames` frames (an
H.264 clip written with PyAV; under 32 frames every one is sampled): decoding, sampling, each frame
through the image path at 70 soft tokens at most, prefill, the first token. `video-e4b`: the E2B/E4B vision tower's shape (16 layers at width 768,
random weights, float32) on `--frames` frames of 70 soft tokens: processing and the encoder.
Needs a checkout of the repository (tests/). Prints one line per shape: the median over `--repeats`
runs and each run, after `--warmup` untimed ones.
`--peer mlx-vlm` (where `mlx_vlm` imports: its own venv, see apps/README.md) also times mlx-vlm on
`tiny` and `video-tiny`: on a copy of the same checkpoint in the layout it loads (`peer_checkpoint`),
`stream_generate` from the same clip (its own feature extractor / video decoder and processor; the
video read at its 8 fps so that every frame is sampled, as ours does) to its first token, greedy; its
line gives its prompt tokens beside ours and its first tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "tests" / "fixtures" / "real_configs"


def tone(seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * np.sin(2 * np.pi * 3 * hz * t)).astype(np.float32)


def _ms(times: list) -> str:
    return f"{1e3 * statistics.median(times):.0f} ms (runs: {', '.join(f'{1e3 * t:.0f}' for t in times)})"


def tiny_ttft(seconds: float, repeats: int, warmup: int, peer: str | None = None) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from chat_helpers import TINY, make_audio_chat_model

    from mlx_mtp import Engine, Request, load

    path = make_audio_chat_model(Path(tempfile.mkdtemp()) / "model")
    loaded = load(path, TINY.parent / "e2b" / "drafter", load_audio=True)
    times, tokens, first = {"audio": [], "text": []}, {}, []
    with Engine(loaded, prompt_cache_bytes=0) as engine:
        for i in range(warmup + repeats):
            for kind in ("audio", "text"):
                parts = [{"type": "audio", "audio": tone(seconds, 200 + 37 * i)}] * (kind == "audio")
                message = {"role": "user", "content": [*parts, {"type": "text", "text": "What do you hear?"}]}
                start = time.perf_counter()
                handle = engine.submit(Request(messages=[message], max_tokens=1))
                token = next(iter(handle))
                if i >= warmup:
                    times[kind].append(time.perf_counter() - start)
                    first += [token.token] if kind == "audio" else []
                handle.result()
                tokens[kind] = handle.prompt_tokens
    line = (f"tiny (E2B-shaped, random weights): TTFT with {seconds:g} s of audio ({tokens['audio'] - tokens['text']} "
            f"audio tokens, {tokens['audio']} in all) {_ms(times['audio'])}; the same request without it "
            f"({tokens['text']} prompt tokens) {_ms(times['text'])}")
    if peer == "mlx-vlm":
        clips = [tone(seconds, 200 + 37 * i) for i in range(warmup + repeats)]
        line += f"; first tokens {first}\n" + peer_ttft("audio", path, clips, ["What do you hear?"] * len(clips),
                                                        tokens["audio"], warmup, f"{seconds:g} s of audio")
    return line


def e4b_encoder(seconds: float, repeats: int, warmup: int) -> str:
    import json

    import mlx.core as mx

    from mlx_mtp.formats import audio as audio_io
    from mlx_mtp.models.gemma4_audio import Audio

    config = json.loads((REAL / "google--gemma-4-E4B-it" / "config.json").read_text())
    audio = Audio.from_config(config)  # random weights, float32
    mx.eval(audio.parameters())
    times = []
    for i in range(warmup + repeats):
        clip = tone(seconds, 200 + 37 * i)
        start = time.perf_counter()
        features, mask = audio_io.log_mel(clip)
        soft = audio.soft_tokens(mx.array(features[None]), mx.array(mask[None]))[0]
        mx.eval(soft)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return (f"e4b audio tower (305M parameters, random weights, float32): log-mel and encoder of {seconds:g} s "
            f"({soft.shape[0]} soft tokens of width {soft.shape[1]}) {_ms(times)}")


def unified_embedder(seconds: float, repeats: int, warmup: int) -> str:
    import json

    import mlx.core as mx

    from mlx_mtp.formats import audio as audio_io
    from mlx_mtp.models.gemma4_unified import Embedders

    config = json.loads((REAL / "google--gemma-4-12B-it" / "config.json").read_text())
    embedders = Embedders.from_config(config)
    mx.eval(embedders.parameters())
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        frames, n = audio_io.unified_frames(tone(seconds, 200 + 37 * i))
        soft = embedders.audio(frames)
        mx.eval(soft)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return f"12b audio embedder (random weights, float32): framing and embedder of {seconds:g} s ({n} soft tokens) {_ms(times)}"


def video_tiny(frames: int, repeats: int, warmup: int, peer: str | None = None) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from chat_helpers import DRAFTER, make_video_chat_model

    from mlx_mtp import Engine, Request, load
    from mlx_mtp.formats import media

    path = make_video_chat_model(Path(tempfile.mkdtemp()) / "model")
    loaded = load(path, DRAFTER, load_vision=True)
    clip = _clip(frames)
    times, tokens, first = [], 0, []
    with Engine(loaded, prompt_cache_bytes=0) as engine:
        for i in range(warmup + repeats):
            message = {"role": "user", "content": [{"type": "video", "video": clip},
                                                   {"type": "text", "text": f"What happens ({i})?"}]}
            start = time.perf_counter()
            handle = engine.submit(Request(messages=[message], max_tokens=1))
            token = next(iter(handle))
            if i >= warmup:
                times.append(time.perf_counter() - start)
                first.append(token.token)
            handle.result()
            tokens = handle.prompt_tokens
    line = (f"video-tiny (26B/31B-like vision, random weights): TTFT with a video of {frames} frames of "
            f"{media.FRAME_BUDGET} soft tokens at most ({tokens} prompt tokens) {_ms(times)}")
    if peer == "mlx-vlm":
        file = Path(tempfile.mkdtemp()) / "clip.mp4"
        file.write_bytes(clip)
        n = warmup + repeats
        line += f"; first tokens {first}\n" + peer_ttft("video", path, [str(file)] * n,
                                                        [f"What happens ({i})?" for i in range(n)], tokens, warmup,
                                                        f"a video of {frames} frames", fps=8)
    return line


PEER_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
               "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
               "video_token": "<|video|>"}


def peer_checkpoint(src: Path, dest: Path) -> Path:
    """A copy of the chat checkpoint at `src` that mlx-vlm loads (strictly), under `dest`: the text
    weights under `model.language_model.`, the released configs' full-layer keys (`global_head_dim`,
    `num_global_key_value_heads`; not `per_layer_config`), the media tokens named in
    `tokenizer_config.json`, a video processor of the vision tower's patch size at 70 soft tokens. mlx-vlm
    builds a vision tower whatever the config says: an audio-only checkpoint gets the vision fixture's
    (tests/fixtures/vision/bidir, whose text width is the same 64), unused by an audio request."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "tokenizer_config.json",
                                                          "processor_config.json", "reference.npz"):
            shutil.copy(f, dest / f.name)
    tokenizer = json.loads((src / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**tokenizer, **PEER_TOKENS}, indent=1))
    config = json.loads((src / "config.json").read_text())
    text = config["text_config"]
    for over in text.pop("per_layer_config", {}).values():
        text["global_head_dim"] = over["head_dim"]
        if "num_key_value_heads" in over:
            text["num_global_key_value_heads"] = over["num_key_value_heads"]
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    media = ("model.language_model.", "model.vision_tower.", "model.embed_vision.", "model.audio_tower.",
             "model.embed_audio.")
    weights = {k if k.startswith(media) else "model.language_model." + k[len("model."):]: v
               for k, v in weights.items()}
    if "vision_config" not in config:
        demo = ROOT / "tests" / "fixtures" / "vision" / "bidir"
        config["vision_config"] = json.loads((demo / "config.json").read_text())["vision_config"]
        config.update(image_token_id=121, boi_token_id=120, eoi_token_id=122)
        weights.update({k: v for k, v in load_file(str(demo / "model.safetensors")).items()
                        if k.startswith(("model.vision_tower.", "model.embed_vision."))})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    vision = config["vision_config"]
    processor = {"max_soft_tokens": 70, "patch_size": vision["patch_size"],
                 "pooling_kernel_size": vision["pooling_kernel_size"]}
    (dest / "processor_config.json").write_text(json.dumps({"image_processor": processor,
                                                            "video_processor": processor}))
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def peer_ttft(kind: str, path: Path, media: list, questions: list, ours: int, warmup: int, what: str,
              **kwargs) -> str:
    """mlx-vlm's time to first token on a copy of our checkpoint (`peer_checkpoint`): for each clip
    (16 kHz samples, or a video file) and question, `stream_generate` to its first token, greedy; its
    prompt tokens beside ours (`ours`)."""
    try:
        import mlx_vlm
        from mlx_vlm import load as vlm_load
        from mlx_vlm import stream_generate
    except ImportError as e:
        return f"mlx-vlm: not run ({e}; it goes in a separate venv: see apps/README.md)"
    model, processor = vlm_load(str(peer_checkpoint(path, Path(tempfile.mkdtemp()))))
    times, first = [], []
    for i, (clip, question) in enumerate(zip(media, questions)):
        message = {"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}
        prompt = processor.tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
        start = time.perf_counter()
        result = next(stream_generate(model, processor, prompt, max_tokens=1, temperature=0.0,
                                      **{kind: [clip]}, **kwargs))
        if i >= warmup:
            times.append(time.perf_counter() - start)
            first.append(result.token)
    same = "the same as ours" if result.prompt_tokens == ours else f"ours: {ours}"
    return (f"mlx-vlm {mlx_vlm.__version__} (same checkpoint): TTFT with {what} ({result.prompt_tokens} prompt "
            f"tokens, {same}) {_ms(times)}; first tokens {first}")


def _clip(frames: int, width: int = 96, height: int = 64) -> bytes:
    """An H.264 MP4 of `frames` frames at 8 fps (fewer than 32: every frame is sampled), in memory."""
    import io

    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("h264", rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        rng = np.random.default_rng(0)
        for _ in range(frames):
            image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def video_e4b(frames: int, repeats: int, warmup: int) -> str:
    import mlx.core as mx

    from apps.vision_ttft import SHAPES as VISION, _random, picture
    from mlx_mtp.formats.images import process
    from mlx_mtp.models.gemma4_vision import Vision, VisionConfig

    params, text_hidden = VISION["e4b"]
    model = Vision(VisionConfig(**params), text_hidden)
    mx.random.seed(0)
    model.update(_random(model.parameters()))
    mx.eval(model.parameters())
    times = []
    for i in range(warmup + repeats):
        shots = [picture(480, 336, seed=i * frames + f) for f in range(frames)]  # 70 soft tokens a frame
        start = time.perf_counter()
        soft = [model(p.pixels, p.positions) for p in (process(s, 70) for s in shots)]
        mx.eval(soft)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return (f"video-e4b vision tower ({params['num_hidden_layers']} x {params['hidden_size']}, random weights, "
            f"float32): processing and encoder of {frames} frames of {soft[0].shape[0]} soft tokens {_ms(times)}")


SHAPES = {"tiny": tiny_ttft, "e4b": e4b_encoder, "12b": unified_embedder, "video-tiny": video_tiny,
          "video-e4b": video_e4b}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m apps.media_ttft", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shapes", default="tiny,e4b,12b,video-tiny,video-e4b", help="which shapes (comma list)")
    ap.add_argument("--seconds", type=float, default=10.0, help="the audio clip's length")
    ap.add_argument("--frames", type=int, default=16, help="the video's sampled frames")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per shape (the median is printed)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    ap.add_argument("--peer", choices=["mlx-vlm"], help="tiny and video-tiny also on this peer, where it imports")
    args = ap.parse_args(argv)
    import mlx.core as mx

    print(f"device {mx.default_device()}, mlx {mx.__version__}", flush=True)
    for shape in args.shapes.split(","):
        size = args.frames if shape.startswith("video") else args.seconds
        peer = {"peer": args.peer} if args.peer and shape in ("tiny", "video-tiny") else {}
        print(SHAPES[shape](size, args.repeats, args.warmup, **peer), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
