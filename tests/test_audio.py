"""Audio in (mlx_mtp.formats.audio): decoding, the E2B/E4B log-mel features, the 12B's frames and the
soft-token counts, against transformers 5.23 (tests/fixtures/audio, made by make_audio_fixtures.py)."""

import base64
import hashlib
import io
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from mlx_mtp.formats import audio
from mlx_mtp.formats.audio import AudioError, audio_tokens, load_audio, log_mel, segments, unified_frames

FIXTURES = Path(__file__).parent / "fixtures" / "audio"
LENGTHS = (0, 160, 161, 320, 321, 8000, 16000, 480000, 640000)
KINDS = ("sine", "noise", "silence")
ATOL = 1e-5
# soundfile's wheels bundle libsndfile with MP3 (1.1+); a system libsndfile may lack it
needs_mp3 = pytest.mark.skipif("MP3" not in sf.available_formats(), reason="this libsndfile reads no MP3")
MP3 = pytest.param("MP3", "MPEG_LAYER_III", marks=needs_mp3)


@cache
def fixture(name: str) -> dict:
    return dict(np.load(FIXTURES / name))


def signal(kind: str, n: int) -> np.ndarray:
    """make_audio_fixtures.signal: two tones, seeded uniform noise, or digital silence."""
    if kind == "sine":  # rounded to 16 bits, so that no platform's sin() can change a sample
        t = np.arange(n) / 16000
        tones = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.25 * np.sin(2 * np.pi * 3000 * t)
        return (np.round(tones * 32767) / 32768).astype(np.float32)
    if kind == "noise":  # integers: the same draws on every platform
        return (np.random.default_rng(n).integers(-3277, 3278, n) / 32768).astype(np.float32)
    return np.zeros(n, np.float32)


def made(kind: str, n: int) -> np.ndarray:
    x = signal(kind, n)
    assert hashlib.sha256(x.tobytes()).hexdigest() == str(fixture("mel.npz")[f"{kind}_{n}_sha256"]), \
        "this platform's numpy made a different test input than the fixture script's"
    return x


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_log_mel_matches_transformers(kind, n):
    ref, x = fixture("mel.npz"), made(kind, n)
    clips = segments(x)
    if n > audio.SEGMENT:  # transformers keeps 30 s of it; we split it into pieces it reads whole
        assert int(ref[f"{kind}_{n}_hf_frames"]) == 2999
        with pytest.raises(AudioError, match="split it with segments"):
            log_mel(x)
    for i, clip in enumerate(clips):
        key = f"{kind}_{n}_{i}"
        assert len(clip) == ref[f"{key}_length"]
        features, mask = log_mel(clip)
        assert features.dtype == np.float32 and mask.dtype == bool
        assert features.shape == (len(ref[f"{key}_mask"]), 128) and (mask == ref[f"{key}_mask"]).all()
        assert mask.sum() == audio.mel_frames(len(clip)) and (features[~mask] == 0).all()
        np.testing.assert_allclose(features[ref[f"{key}_rows"]], ref[f"{key}_features"], rtol=0, atol=ATOL)
        np.testing.assert_allclose(features.astype(np.float64).sum(axis=1), ref[f"{key}_rowsum"], rtol=0,
                                   atol=128 * ATOL)
        assert (features[mask, 0] == np.float32(np.log(1e-3))).all()  # mel filter 0 is empty
        assert audio_tokens(len(clip)) == ref[f"{key}_tokens"] == ref[f"{key}_tokens_mask"]
    assert f"{kind}_{n}_{len(clips)}_length" not in ref


def steps(breaks, values, last):
    """A step function given by its breaks, at 0 .. last."""
    return values[np.searchsorted(breaks, np.arange(last + 1), side="right") - 1]


def test_token_counts_equal_the_processors_for_every_length_to_500000():
    ref = fixture("tokens.npz")
    last = 500_000
    hf = steps(ref["e_breaks"], ref["e_values"], last)
    ours = np.fromiter((audio_tokens(n) for n in range(last + 1)), np.int64, last + 1)
    assert (ours == hf).all()
    hf = steps(ref["unified_breaks"], ref["unified_values"], last)
    assert (np.fromiter((audio.unified_tokens(n) for n in range(last + 1)), np.int64, last + 1) == hf).all()
    # the research note's figures: 10 ms -> 0, 0.5 s -> 13, 1 s -> 25, 10 s -> 250, 30 s and 40 s -> 750
    assert [audio_tokens(s) for s in (160, 8000, 16000, 160000, 480000, 640000)] == [0, 13, 25, 250, 750, 750]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_unified_frames_equal_transformers_exactly(kind, n):
    ref, x = fixture("unified.npz"), made(kind, n)
    frames, n_tokens = unified_frames(x)
    assert frames.dtype == np.float32 and frames.shape == tuple(ref[f"{kind}_{n}_shape"])
    assert hashlib.sha256(frames.tobytes()).hexdigest() == str(ref[f"{kind}_{n}_sha256"])
    assert n_tokens == ref[f"{kind}_{n}_tokens"] == ref[f"{kind}_{n}_mask"] == -(-n // 640)
    if n:
        assert (frames[-1] == ref[f"{kind}_{n}_last"]).all()
        assert (frames[-1, n - 640 * (n_tokens - 1):] == 0).all()  # the last frame's padding is zeros


def test_segments_split_long_audio_into_equal_pieces_and_drop_nothing():
    for n, lengths in [(480000, [480000]), (480001, [240001, 240000]), (640000, [320000, 320000]),
                       (1_440_001, [360001, 360000, 360000, 360000]), (5, [5])]:
        x = np.arange(n, dtype=np.float32)
        pieces = segments(x)
        assert [len(p) for p in pieces] == lengths and (np.concatenate(pieces) == x).all()
        assert all(audio_tokens(len(p)) == -(-audio.mel_frames(len(p)) // 4) for p in pieces)  # none capped


@pytest.mark.parametrize("name", ["stereo_44100.wav", "mono_22050.flac", "stereo_48000.ogg",
                                  pytest.param("mono_44100.mp3", marks=needs_mp3)])
def test_decoding_equals_transformers_load_audio(name):
    """transformers' load_audio(backend="soundfile"): channels averaged, soxr HQ, ceil(n * 16000 / rate)."""
    got = load_audio(FIXTURES / "decode" / name)
    want = fixture("decode.npz")[name]
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)  # the same bits here; SIMD may differ elsewhere


def tone(rate=44100, seconds=0.5, channels=1):
    t = np.arange(int(rate * seconds))[:, None] / rate
    return (0.5 * np.sin(2 * np.pi * (440 + 110 * np.arange(channels)) * t)).astype(np.float32)


def encoded(x, rate, fmt, subtype=None) -> bytes:
    out = io.BytesIO()
    sf.write(out, x, rate, format=fmt, subtype=subtype)
    return out.getvalue()


@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", "PCM_16"),
                                         ("OGG", "VORBIS"), MP3])
def test_each_format_decodes_to_16k_mono(fmt, subtype, tmp_path):
    x = tone(44100, 0.5, 2)
    data = encoded(x, 44100, fmt, subtype)
    path = tmp_path / f"clip.{fmt.lower()}"
    path.write_bytes(data)
    want = load_audio(x, sampling_rate=44100)  # the array itself, resampled
    url = f"data:audio/{fmt.lower()};base64,{base64.b64encode(data).decode()}"
    for source in (path, str(path), data, url):
        got = load_audio(source)
        assert got.dtype == np.float32 and got.ndim == 1 and len(got) == 8000
        if subtype in ("PCM_16", "FLOAT"):  # lossless: the array, up to 16-bit quantisation
            np.testing.assert_allclose(got, want, atol=1e-4 if subtype == "PCM_16" else 1e-7)
        else:  # lossy: the same tone (codec delay and loss aside)
            assert abs(np.sqrt(np.mean(got[2000:6000] ** 2)) - np.sqrt(np.mean(want ** 2))) < 0.05


def test_arrays_take_their_rate_and_layout():
    x = tone(16000, 0.25)
    assert (load_audio(x[:, 0], sampling_rate=16000) == x[:, 0]).all()  # 16 kHz mono: as it is
    stereo = tone(16000, 0.25, 2)
    np.testing.assert_array_equal(load_audio(stereo, sampling_rate=16000), stereo.mean(axis=1))
    pcm = (x[:, 0] * 32767).astype(np.int16)
    np.testing.assert_array_equal(load_audio(pcm, sampling_rate=16000), pcm / np.float32(32768))
    assert len(load_audio(tone(8000, 0.25)[:, 0], sampling_rate=8000)) == 4000
    assert len(load_audio(np.zeros(441, np.float64), sampling_rate=44100)) == 160


def wav(x=None, rate=16000, subtype="PCM_16") -> bytes:
    return encoded(tone(rate, 1.0) if x is None else x, rate, "WAV", subtype)


def refused(source, match, **kw):
    with pytest.raises(AudioError, match=match) as e:
        load_audio(source, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_not_audio_is_refused_in_one_line(tmp_path):
    refused(b"hello, this is text and not a sound", "the audio file is in no format libsndfile reads")
    refused(b"\x89PNG\r\n\x1a\n" + bytes(200), "in no format libsndfile reads")
    refused(tmp_path / "missing.wav", "no audio file at")
    refused(base64.b64encode(wav()).decode(), "no audio file at")  # base64 without its data: prefix
    refused(b"", "in no format")
    refused("https://example.com/a.wav", "not fetched")
    refused("data:image/png;base64,AAAA", "media type must be audio")
    refused("data:audio/wav;base64,@@@", "not valid base64")
    refused([0.0, 0.1], "not list")


def test_truncated_and_corrupt_files_are_refused():
    refused(wav()[:16000], "truncated or corrupt: it ends after 0.50 s")
    flac = encoded(tone(16000, 1.0), 16000, "FLAC", "PCM_16")
    refused(flac[: len(flac) // 2], "truncated or corrupt")
    if "MP3" in sf.available_formats():
        mp3 = encoded(tone(16000, 1.0), 16000, "MP3", "MPEG_LAYER_III")
        refused(mp3[: len(mp3) // 2], "truncated or corrupt: it ends after")
    ogg = bytearray(encoded(tone(16000, 1.0), 16000, "OGG", "VORBIS"))
    ogg[len(ogg) // 3: len(ogg) // 3 + 200] = bytes(200)
    refused(bytes(ogg), "truncated or corrupt")
    header = bytearray(wav())
    header[22:24] = (0).to_bytes(2, "little")  # zero channels
    refused(bytes(header), "truncated or corrupt")


def test_a_streamed_wav_with_a_placeholder_size_is_not_truncated():
    data = bytearray(wav())
    at = data.find(b"data") + 4
    data[at:at + 4] = (0xFFFFFFFF).to_bytes(4, "little")
    assert len(load_audio(bytes(data))) == 16000


def test_empty_long_and_badly_rated_audio_is_refused(monkeypatch):
    refused(wav(np.zeros(0, np.float32)), r"holds no audio \(0 s\)")
    refused(np.zeros(0, np.float32), r"holds no audio \(0 s\)", sampling_rate=16000)
    two_hours = np.broadcast_to(np.float32(0), (7200 * 16000,))  # no memory: refused before it is read
    assert "7200.0 s long" in refused(two_hours, "audio is taken up to 600 s", sampling_rate=16000)
    monkeypatch.setattr(audio, "MAX_SECONDS", 1)
    refused(wav(tone(16000, 2.0)), "2.0 s long; audio is taken up to 1 s")
    for rate in (None, 0, -16000, 44100.5, 10**7, 100, True, "16000", float("nan"), float("inf")):
        refused(np.zeros(100, np.float32), "sampling_rate", sampling_rate=rate)
    refused(wav(), "sampling_rate is for arrays", sampling_rate=16000)


def test_bad_arrays_are_refused():
    refused(np.zeros((2, 16000), np.float32), r"channels-first array needs \.T", sampling_rate=16000)
    refused(np.zeros((4, 4, 4), np.float32), "not shape", sampling_rate=16000)
    refused(np.array([0.0, np.nan], np.float32), "NaN", sampling_rate=16000)
    refused(np.zeros(10, np.complex64), "not complex64", sampling_rate=16000)
    with pytest.raises(AudioError, match="1-D float numpy array"):
        log_mel(np.zeros((10, 2), np.float32))
    with pytest.raises(AudioError, match="NaN"):
        unified_frames(np.array([np.inf], np.float32))


def test_mp3_without_libsndfile_support_says_what_to_upgrade(monkeypatch):
    monkeypatch.setattr(sf, "available_formats", lambda: {"WAV": "", "FLAC": ""})
    refused(b"ID3\x04" + bytes(300), "MP3, which needs libsndfile 1.1 or newer")


def test_log_mel_of_nothing_is_empty_as_in_transformers():
    for n in (0, 1, 128):
        features, mask = log_mel(np.zeros(n, np.float32))
        assert features.shape == (0, 128) and mask.shape == (0,)
    assert unified_frames(np.zeros(0, np.float32))[0].shape == (0, 640)
