"""Audio in, as Gemma 4 takes it: decoded to 16 kHz mono, then log-mel frames (E2B/E4B) or raw
640-sample frames (the 12B). numpy, soundfile and soxr; no torch.

Decoding is libsndfile's, through soundfile (WAV, FLAC, OGG Vorbis/Opus, MP3 and the other formats
it reads; MP3 needs libsndfile 1.1 or newer, which soundfile's wheels bundle), and resampling is
soxr's, as transformers' `load_audio(backend="soundfile")` does it: float32 samples, channels
averaged, soxr HQ to 16 kHz, ceil(n * 16000 / rate) samples. `log_mel` is transformers'
`Gemma4AudioFeatureExtractor` (5.23) for one clip, and `unified_frames` its
`Gemma4UnifiedAudioFeatureExtractor`; `audio_tokens` and `unified_tokens` count the soft tokens
each gives, as the processors do.

Long audio. The E2B/E4B audio encoder was trained on clips of at most 30 s (750 soft tokens), and
transformers keeps the first 30 s of a longer clip and drops the rest without a word. mlx_mtp never
drops audio: `segments` splits a longer recording into the fewest equal pieces of at most 30 s, and
each piece goes into the prompt as an audio block of its own (`<|audio>` ... `<audio|>`), one after
the other, as llama.cpp does; `log_mel` refuses a clip over 30 s rather than cut it. Split rather than
refuse, because a recording of a few minutes is an ordinary request and the model hears every piece
whole; equal pieces rather than 30 s and a remainder, because a remainder can be a few milliseconds,
which give no soft token at all. The 12B reads raw frames with no such limit, so its audio is never
split. Any audio over ten minutes (`MAX_SECONDS`: 15,000 soft tokens at 25 a second) is refused
before it is decoded.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np

from . import dataurl

SAMPLE_RATE = 16_000
MAX_SECONDS = 600  # longer audio is refused before it is decoded
MIN_RATE, MAX_RATE = 4_000, 384_000  # sampling rates an array may declare
MAX_CHANNELS = 32  # an array with more "channels" is taken to be channels-first, and refused
SEGMENT = 30 * SAMPLE_RATE  # the most samples the E2B/E4B encoder reads at once (transformers' max_length)
SEGMENT_TOKENS = 750  # its soft tokens (the processor's audio_seq_length)
FRAME, HOP, FFT, MELS = 320, 160, 512, 128  # 20 ms periodic-Hann window, 10 ms hop, 128 HTK mel bins
MEL_FLOOR = 1e-3  # added before the log
PAD_TO = 128  # transformers pads a clip to a multiple of 128 samples: the frame count depends on it
UNIFIED_FRAME = 640  # samples in one 12B audio frame (40 ms): one soft token


class AudioError(ValueError):
    """Audio that cannot be read or used (the message says why, in one line)."""


AudioSource = str | Path | bytes | bytearray | memoryview | np.ndarray


def load_audio(source: AudioSource, sampling_rate: int | None = None) -> np.ndarray:
    """16 kHz mono float32 samples, shape (n,), from a path, the bytes of a file, a
    `data:audio/...;base64,` URL, or a numpy array with its `sampling_rate`: (n,) or (n, channels)
    as soundfile returns it, float or int16/int32 PCM. Files carry their own rate. Channels are
    averaged and other rates resampled (see the module docstring). Raises AudioError for anything
    that is not usable audio: not audio, truncated, corrupt, empty, over `MAX_SECONDS`, a bad rate."""
    if isinstance(source, np.ndarray):
        if sampling_rate is None:
            raise AudioError("an audio array needs its sampling_rate")
        rate = _rate(sampling_rate)
        samples = _from_array(source, rate)
    else:
        if sampling_rate is not None:
            raise AudioError("sampling_rate is for arrays: an audio file carries its own")
        samples, rate = _decode(source)
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    if rate != SAMPLE_RATE:
        import soxr

        n = -(-len(mono) * SAMPLE_RATE // rate)
        mono = soxr.resample(mono, rate, SAMPLE_RATE, quality="HQ")
        mono = np.pad(mono, (0, max(0, n - len(mono))))[:n]
    return np.array(mono, dtype=np.float32)


def log_mel(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The E2B/E4B audio encoder's input for one clip of at most 30 s of 16 kHz mono samples (n,).

    Returns (features, mask): features (T, 128) float32, the log of 128 HTK mel bins of the
    magnitude spectrum of each 20 ms frame, 10 ms apart; mask (T,) bool, True for the frames made
    of real samples only (the first `mel_frames(n)`); the other frames are zero. T counts the frames
    of the clip padded as transformers pads it (to a multiple of 128 samples), so the arrays equal
    its `input_features[0]` and `input_features_mask[0]`. A clip over 30 s is refused (`segments`)."""
    x = _clip(samples)
    n = len(x)
    if n > SEGMENT:
        raise AudioError(f"the clip is {n / SAMPLE_RATE:.2f} s; the audio encoder reads at most "
                         f"{SEGMENT // SAMPLE_RATE} s at once: split it with segments()")
    padded = np.zeros(FRAME // 2 + -(-n // PAD_TO) * PAD_TO, np.float32)  # semicausal: half a frame before
    padded[FRAME // 2:FRAME // 2 + n] = x
    frames = max(0, (len(padded) - (FRAME + 1)) // HOP + 1)  # windows of 321, the last sample unused
    mask = np.arange(frames) < mel_frames(n)
    if frames == 0:
        return np.zeros((0, MELS), np.float32), mask
    windows = np.lib.stride_tricks.sliding_window_view(padded, FRAME)[: frames * HOP : HOP]
    magnitude = np.abs(np.fft.rfft(windows * _WINDOW, n=FFT, axis=-1))  # complex64 -> float32
    features = np.log(magnitude @ _MEL_BANK + MEL_FLOOR).astype(np.float32)
    return np.where(mask[:, None], features, np.float32(0)), mask


def mel_frames(n_samples: int) -> int:
    """Valid log-mel frames of a clip of n samples: those whose window holds only real samples."""
    return max(0, (n_samples - (FRAME // 2 + 1)) // HOP + 1)


def audio_tokens(n_samples: int) -> int:
    """Soft tokens the E2B/E4B encoder gives a clip of n samples: the valid mel frames through two
    stride-2 convolutions, ceil(frames / 4) (0 for 10 ms or less), at most 750. Equal to transformers'
    `Gemma4Processor._compute_audio_num_tokens` for every n; over 30 s that is its count for the 30 s
    it keeps. mlx_mtp feeds longer audio as `segments`: `[audio_tokens(len(s)) for s in segments(x)]`."""
    return min(-(-mel_frames(n_samples) // 4), SEGMENT_TOKENS)


def segments(samples: np.ndarray) -> list[np.ndarray]:
    """The clips the E2B/E4B encoder reads for 16 kHz mono samples (n,): the whole when it is 30 s
    or shorter, else the fewest equal consecutive pieces of at most 30 s (views, nothing dropped)."""
    x = _clip(samples)
    return np.array_split(x, max(1, -(-len(x) // SEGMENT)))


def unified_frames(samples: np.ndarray) -> tuple[np.ndarray, int]:
    """The 12B's audio input for 16 kHz mono samples (n,): (frames, n_tokens), frames
    (n_tokens, 640) float32 of consecutive samples, the last frame padded with zeros; one soft
    token a frame, n_tokens = ceil(n / 640), with no upper limit (as `Gemma4UnifiedAudioFeatureExtractor`)."""
    x = _clip(samples)
    n_tokens = unified_tokens(len(x))
    frames = np.zeros((n_tokens, UNIFIED_FRAME), np.float32)
    frames.reshape(-1)[: len(x)] = x
    return frames, n_tokens


def unified_tokens(n_samples: int) -> int:
    """Soft tokens the 12B gives n samples: ceil(n / 640)."""
    return -(-n_samples // UNIFIED_FRAME)


def _mel_bank() -> np.ndarray:
    """(257, 128) float64 triangular HTK mel filters over 0-8 kHz, unnormalised (filter 0 is all zero:
    it ends below the first FFT bin above 0 Hz)."""
    def mel(hz):
        return 2595.0 * np.log10(1.0 + hz / 700.0)

    edges = 700.0 * (10.0 ** (np.linspace(mel(0.0), mel(SAMPLE_RATE / 2), MELS + 2) / 2595.0) - 1.0)
    bins = np.linspace(0, SAMPLE_RATE // 2, FFT // 2 + 1)[:, None]
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = (bins - lower) / (centre - lower)
    falling = (upper - bins) / (upper - centre)
    return np.maximum(0.0, np.minimum(rising, falling))


_WINDOW = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(FRAME) / FRAME)).astype(np.float32)  # periodic Hann
_MEL_BANK = _mel_bank()


def _clip(samples) -> np.ndarray:
    """Samples as a 1-D float32 array (AudioError when they are not 1-D finite real numbers)."""
    if not isinstance(samples, np.ndarray) or samples.ndim != 1 or samples.dtype.kind != "f":
        what = (f"{samples.dtype} of shape {samples.shape}" if isinstance(samples, np.ndarray)
                else type(samples).__name__)
        raise AudioError(f"audio samples are a 1-D float numpy array (load_audio's), not {what}")
    x = samples.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        raise AudioError("the audio samples hold NaN or infinite values")
    return x


def _rate(sampling_rate) -> int:
    number = isinstance(sampling_rate, (int, float, np.integer, np.floating))
    number = number and not isinstance(sampling_rate, bool)
    if not (number and MIN_RATE <= sampling_rate <= MAX_RATE and sampling_rate == int(sampling_rate)):
        raise AudioError(f"an audio array's sampling_rate must be a whole number of Hz from {MIN_RATE} to "
                         f"{MAX_RATE}, not {sampling_rate!r}")
    return int(sampling_rate)


_PCM_SCALE = {np.dtype(np.int16): 2.0**15, np.dtype(np.int32): 2.0**31}  # soundfile's int -> float scale


def _from_array(array: np.ndarray, rate: int) -> np.ndarray:
    """(n, channels) float32 from an array of samples at `rate` Hz."""
    if array.ndim not in (1, 2):
        raise AudioError(f"an audio array is (samples,) or (samples, channels), not shape {array.shape}")
    if array.ndim == 2 and not 1 <= array.shape[1] <= MAX_CHANNELS:
        raise AudioError(f"an audio array is (samples, channels) with 1 to {MAX_CHANNELS} channels, not "
                         f"shape {array.shape} (a channels-first array needs .T)")
    if array.dtype.kind != "f" and array.dtype not in _PCM_SCALE:
        raise AudioError(f"audio samples are float or int16/int32 PCM, not {array.dtype}")
    _check_length(len(array), rate, "the audio array")
    samples = array.reshape(len(array), -1)
    if array.dtype in _PCM_SCALE:
        samples = samples / np.float32(_PCM_SCALE[array.dtype])
    samples = samples.astype(np.float32)
    if not np.isfinite(samples).all():
        raise AudioError("the audio array holds NaN or infinite values")
    return samples


def _check_length(frames: int, rate: int, name: str) -> None:
    if frames == 0:
        raise AudioError(f"{name} holds no audio (0 s)")
    if frames > MAX_SECONDS * rate:
        raise AudioError(f"{name} is {frames / rate:.1f} s long; audio is taken up to {MAX_SECONDS} s "
                         f"({MAX_SECONDS // 60} min)")


def _decode(source) -> tuple[np.ndarray, int]:
    """(samples (n, channels) float32, rate) decoded by libsndfile."""
    import soundfile as sf

    if isinstance(source, str) and source.startswith("data:"):
        source = decode_data_url(source)
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise AudioError("audio URLs are not fetched: send the audio as base64 data")
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        stream, name, head = io.BytesIO(data), "the audio file", data[:4]
    elif isinstance(source, (str, Path)):
        try:
            found = Path(source).is_file()
        except (OSError, ValueError):  # a name too long for a path (base64 without its data: prefix?)
            found = False
        if not found:
            raise AudioError(f"no audio file at {str(source)[:200]}")
        stream, name = str(source), str(source)
        with open(source, "rb") as f:
            head = f.read(4)
    else:
        raise AudioError(f"audio is a path, bytes, a data URL or a numpy array, not {type(source).__name__}")
    try:
        with sf.SoundFile(stream) as f:
            rate, declared = f.samplerate, f.frames
            _check_length(declared, rate, name)
            samples = f.read(dtype="float32", always_2d=True)
            log = f.extra_info
    except AudioError:
        raise
    except (sf.SoundFileError, RuntimeError) as e:
        raise AudioError(_unreadable(name, e, head)) from None
    if _truncated(log, declared, len(samples)):
        raise AudioError(f"{name} is truncated or corrupt: it ends after {len(samples) / rate:.2f} s, "
                         "before the end its header declares")
    _check_length(len(samples), rate, name)
    return samples, rate


def _unreadable(name: str, error: Exception, head: bytes) -> str:
    import soundfile as sf

    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    reason = re.sub(r"^Error opening .*?: ", "", reason).removeprefix("Error : ").rstrip(".")
    sync = len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0  # an MPEG frame header
    mp3 = head[:3] == b"ID3" or sync
    if mp3 and "MP3" not in sf.available_formats():
        return (f"{name} looks like MP3, which needs libsndfile 1.1 or newer (soundfile has "
                f"{sf.__libsndfile_version__}): pip install -U soundfile")
    if reason.lower() == "format not recognised":
        return f"{name} is in no format libsndfile reads (WAV, FLAC, OGG, MP3, ...)"
    return f"{name} is truncated or corrupt ({reason})"


_WAV_DATA = re.compile(r"^data\s*:\s*(\d+) \(should be (\d+)\)", re.MULTILINE)


def _truncated(log: str, declared: int, read: int) -> bool:
    """Whether the file ends before its header says. libsndfile reads a truncated WAV to its end and
    says so only in its log ("data : <declared bytes> (should be <bytes present>)"; the placeholder
    sizes of streamed WAVs, 2^31 - 1 and up, are not truncation); MP3 and others read short. An MP3
    without a Xing header has a length estimated from its bit rate, hence the 10% slack."""
    wav = _WAV_DATA.search(log)
    if wav and int(wav.group(2)) < int(wav.group(1)) < 0x7FFFFFFF:
        return True
    return read < declared - declared // 10


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:audio/<type>;base64,<data>` URL (AudioError for any other form)."""
    return dataurl.decode(url, "audio", AudioError)


