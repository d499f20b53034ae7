"""Generate the Gemma 4 audio fixtures (log-mel features, the 12B's frames, soft-token counts, decoding).

Ground truth is transformers==5.23.0 (numpy only: no torch is run) with soundfile and soxr. Usage:

    /tmp/ref-venv/bin/python tests/reference/make_audio_fixtures.py [--out tests/fixtures/audio]

Deterministic (formulas and a seeded numpy Generator). What it writes under <out>:

* ``mel.npz``: ``Gemma4AudioFeatureExtractor()`` (the released config is the class defaults) on
  ``signal(kind, n)`` for kind in sine, noise, silence and n in LENGTHS, one clip at a time as a
  list of one array. Per case ``{kind}_{n}``:
  - ``_sha256``: of the input's float32 bytes (the test checks it made the same input);
  - ``_hf_frames``: the frames transformers gives for the whole input (2999 for any n over 30 s:
    it truncates to 480,000 samples);
  - per clip i (``_{i}_``): the whole for n <= 480,000, else ``np.array_split`` into the fewest
    equal pieces of at most 480,000 samples (what ``mlx_mtp.formats.audio.segments`` makes):
    ``length`` (samples), ``mask`` (T,) bool, ``rows`` (frame indices) and ``features`` (rows, 128)
    float32 (every frame when T <= 120, else the first and last 8 and every 97th), ``rowsum`` (T,)
    float64 sum of each frame's 128 values, ``tokens`` (``Gemma4Processor._compute_audio_num_tokens``)
    and ``tokens_mask`` (its ``replace_audio_token``, which counts from the mask).
* ``unified.npz``: ``Gemma4UnifiedAudioFeatureExtractor()`` on the same inputs, whole: ``{kind}_{n}_``
  ``shape``, ``sha256`` (the float32 bytes of ``input_features[0]``), ``mask`` sum, ``last`` (the last
  frame, zero-padded) and ``tokens`` (``Gemma4UnifiedProcessor._compute_audio_num_tokens``).
* ``tokens.npz``: both processors' ``_compute_audio_num_tokens`` for every n in [0, 500000], kept as
  the step function it is: ``{e,unified}_breaks`` (the n where the count changes, and 0) and
  ``{e,unified}_values`` (the count from each break on).
* ``decode/``: four small files written here with soundfile (``CLIPS``: WAV, FLAC, OGG Vorbis and MP3,
  mono and stereo, 22.05-48 kHz, 0.2 s) and ``decode.npz``, what transformers'
  ``load_audio(path, backend="soundfile")`` gives for each (16 kHz mono float32). The .ogg's bytes change
  from run to run (a random Ogg stream serial number); its samples do not. Everything else is byte-identical.
* ``meta.json``: the library versions.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import types
from pathlib import Path

import numpy as np

LENGTHS = (0, 160, 161, 320, 321, 8000, 16000, 480000, 640000)
KINDS = ("sine", "noise", "silence")
SEGMENT = 480_000
TOKEN_RANGE = 500_000
# name: (rate, channels, seconds, format, subtype)
CLIPS = {
    "stereo_44100.wav": (44100, 2, 0.2, "WAV", "PCM_16"),
    "mono_22050.flac": (22050, 1, 0.2, "FLAC", "PCM_16"),
    "stereo_48000.ogg": (48000, 2, 0.2, "OGG", "VORBIS"),
    "mono_44100.mp3": (44100, 1, 0.2, "MP3", "MPEG_LAYER_III"),
}


def signal(kind: str, n: int) -> np.ndarray:
    """A 16 kHz float32 test input: two tones, seeded uniform noise (about +-0.1), or digital silence."""
    if kind == "sine":  # rounded to 16 bits, so that no platform's sin() can change a sample
        t = np.arange(n) / 16000
        tones = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.25 * np.sin(2 * np.pi * 3000 * t)
        return (np.round(tones * 32767) / 32768).astype(np.float32)
    if kind == "noise":  # integers: the same draws on every platform
        return (np.random.default_rng(n).integers(-3277, 3278, n) / 32768).astype(np.float32)
    return np.zeros(n, np.float32)


def clip_audio(rate: int, channels: int, seconds: float) -> np.ndarray:
    """(frames, channels) float32 for a decode clip: a different tone in each channel."""
    t = np.arange(int(rate * seconds))[:, None] / rate
    return (0.4 * np.sin(2 * np.pi * (330 + 220 * np.arange(channels)) * t)).astype(np.float32)


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def rows(frames: int) -> np.ndarray:
    if frames <= 120:
        return np.arange(frames)
    return np.unique(np.concatenate([np.arange(8), np.arange(frames - 8, frames), np.arange(0, frames, 97)]))


def processors():
    """The two processors' token methods, on stand-ins holding only what those methods read."""
    from transformers import Gemma4AudioFeatureExtractor, Gemma4Processor
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )
    from transformers.models.gemma4_unified.processing_gemma4_unified import Gemma4UnifiedProcessor

    cap = inspect.signature(Gemma4Processor.__init__).parameters["audio_seq_length"].default  # 750
    e = types.SimpleNamespace(feature_extractor=Gemma4AudioFeatureExtractor(), audio_seq_length=cap,
                              boa_token="<", audio_token="a", eoa_token=">")
    u = types.SimpleNamespace(feature_extractor=Gemma4UnifiedAudioFeatureExtractor())

    def e_tokens(n):  # the token methods read only len() of the waveform: a range stands in for n samples
        return Gemma4Processor._compute_audio_num_tokens(e, range(n), 16000)

    def e_tokens_mask(mask):
        return Gemma4Processor.replace_audio_token(e, {"input_features_mask": [mask]}, 0).count("a")

    def u_tokens(n):
        return Gemma4UnifiedProcessor._compute_audio_num_tokens(u, range(n), 16000)

    return e.feature_extractor, u.feature_extractor, e_tokens, e_tokens_mask, u_tokens


def steps(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(breaks, values at them) of a step function given at 0, 1, 2, ..."""
    breaks = np.concatenate([[0], np.flatnonzero(np.diff(values)) + 1])
    return breaks.astype(np.int64), values[breaks].astype(np.int64)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "fixtures" / "audio"))
    out = Path(parser.parse_args().out)
    (out / "decode").mkdir(parents=True, exist_ok=True)

    import soundfile as sf
    import soxr
    import transformers
    from transformers.audio_utils import load_audio

    mel_fe, unified_fe, e_tokens, e_tokens_mask, u_tokens = processors()
    mel, unified = {}, {}
    for kind in KINDS:
        for n in LENGTHS:
            x, key = signal(kind, n), f"{kind}_{n}"
            mel[f"{key}_sha256"] = sha256(x)
            mel[f"{key}_hf_frames"] = mel_fe([x], return_tensors="np")["input_features"].shape[1]
            for i, clip in enumerate(np.array_split(x, max(1, -(-n // SEGMENT)))):
                got = mel_fe([clip], return_tensors="np")
                features, mask = got["input_features"][0], got["input_features_mask"][0].astype(bool)
                assert features.dtype == np.float32 and (features[~mask] == 0).all()
                tokens = e_tokens(len(clip))
                assert tokens == e_tokens_mask(mask), (key, i)  # the two counts of the processor agree
                kept = rows(len(mask))
                mel.update({f"{key}_{i}_length": len(clip), f"{key}_{i}_mask": mask, f"{key}_{i}_rows": kept,
                            f"{key}_{i}_features": features[kept],
                            f"{key}_{i}_rowsum": features.astype(np.float64).sum(axis=1),
                            f"{key}_{i}_tokens": tokens, f"{key}_{i}_tokens_mask": e_tokens_mask(mask)})
            got = unified_fe([x], return_tensors="np")
            frames, mask = got["input_features"][0], got["input_features_mask"][0]
            assert frames.dtype == np.float32 and mask.all() and len(frames) == u_tokens(n)
            unified.update({f"{key}_shape": np.array(frames.shape), f"{key}_sha256": sha256(frames),
                            f"{key}_mask": int(mask.sum()), f"{key}_tokens": u_tokens(n),
                            f"{key}_last": frames[-1] if len(frames) else np.zeros(640, np.float32)})
    np.savez_compressed(out / "mel.npz", **mel)
    np.savez_compressed(out / "unified.npz", **unified)

    e_all = np.array([e_tokens(n) for n in range(TOKEN_RANGE + 1)])
    u_all = np.array([u_tokens(n) for n in range(TOKEN_RANGE + 1)])
    assert (np.diff(e_all) >= 0).all() and (np.diff(u_all) >= 0).all()
    (e_breaks, e_values), (u_breaks, u_values) = steps(e_all), steps(u_all)
    np.savez_compressed(out / "tokens.npz", e_breaks=e_breaks, e_values=e_values, unified_breaks=u_breaks,
                        unified_values=u_values)

    decoded = {}
    for name, (rate, channels, seconds, fmt, subtype) in CLIPS.items():
        path = out / "decode" / name
        sf.write(path, clip_audio(rate, channels, seconds), rate, format=fmt, subtype=subtype)
        decoded[name] = load_audio(str(path), sampling_rate=16000, backend="soundfile")
        assert decoded[name].dtype == np.float32 and decoded[name].ndim == 1
    np.savez_compressed(out / "decode.npz", **decoded)

    meta = {"transformers": transformers.__version__, "numpy": np.__version__, "soundfile": sf.__version__,
            "libsndfile": sf.__libsndfile_version__, "soxr": soxr.__version__}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    sizes = {p.name: p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    print(json.dumps(sizes), sum(sizes.values()))


if __name__ == "__main__":
    main()
