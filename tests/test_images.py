"""The torch-free image processor equals transformers 5.23's `Gemma4ImageProcessorPil` bit for bit
(fixtures: tests/reference/make_vision_fixtures.py), and bad images fail in one clear line."""

import base64
import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mlx_mtp.formats import images
from mlx_mtp.formats.images import ImageError, process

FIXTURE = Path(__file__).parent / "fixtures" / "vision" / "processor.npz"
CASES = {"square": (64, 64, "RGB"), "photo": (97, 73, "RGB"), "wide": (300, 9, "RGB"), "tall": (5, 211, "RGB"),
         "tiny": (1, 1, "RGB"), "rgba": (40, 30, "RGBA"), "gray": (33, 50, "L"), "big": (517, 389, "RGB"),
         "pano": (1200, 130, "RGB")}


def case_image(w, h, mode):
    """make_vision_fixtures.case_image: an integer formula, no RNG."""
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    yy, xx, cc = np.mgrid[0:h, 0:w, 0:bands].astype(np.int64)
    codes = ((xx * 7 + yy * 3 + cc * 50 + (xx * 31 + yy * 17 + cc * 5) ** 2 % 61) % 256).astype(np.uint8)
    return Image.fromarray(codes[..., 0] if bands == 1 else codes, mode)


def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(CASES))
def test_pixels_positions_and_counts_are_transformers_bitwise(name):
    ref = np.load(FIXTURE)
    image = case_image(*CASES[name])
    for budget in images.BUDGETS:
        key = f"{name}_{budget}"
        got = process(image, budget)
        assert got.tokens == int(ref[f"{key}_tokens"])
        assert list(got.grid) == ref[f"{key}_grid"].tolist()
        assert len(got.pixels) <= int(ref[f"{key}_padded"])
        if f"{key}_pixels" in ref:
            np.testing.assert_array_equal(got.pixels, ref[f"{key}_pixels"])
        assert got.pixels.dtype == np.float32 and sha(got.pixels) == str(ref[f"{key}_pixels_sha256"]), key
        assert sha(got.positions.astype(np.int64)) == str(ref[f"{key}_positions_sha256"]), key
        assert images.soft_tokens(image.height, image.width, budget) == got.tokens


def test_file_bytes_and_data_url_load_alike(tmp_path):
    image = case_image(97, 73, "RGB")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    path = tmp_path / "x.png"
    path.write_bytes(buf.getvalue())
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    digests = {process(src).digest for src in (image, str(path), path, buf.getvalue(), url)}
    assert len(digests) == 1
    other = case_image(98, 73, "RGB")
    assert process(other).digest not in digests


def test_exif_orientation_is_applied_to_files():
    image = case_image(60, 20, "RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    buf = io.BytesIO()
    image.save(buf, format="JPEG", exif=exif)
    assert process(buf.getvalue()).grid[0] < process(buf.getvalue()).grid[1]  # taller than wide


def test_bad_images_are_one_line_errors(tmp_path):
    png = io.BytesIO()
    case_image(64, 64, "RGB").save(png, format="PNG")
    cases = {
        b"not an image at all": "not a readable image",
        png.getvalue()[: len(png.getvalue()) // 2]: "not a readable image",
        "data:image/png;base64,@@@": "not valid base64",
        str(tmp_path / "missing.png"): "no image file",
        3.5: "an image is a path",
    }
    cases["data:text/plain;base64," + base64.b64encode(png.getvalue()).decode()] = "media type must be image"
    for source, words in cases.items():
        with pytest.raises(ImageError, match=words) as e:
            process(source)
        message = str(e.value)  # one clean line: no Python object (`<_io.BytesIO object at 0x...>`)
        assert "\n" not in message and " object at 0x" not in message, message
    assert str(pytest.raises(ImageError, process, b"not an image at all").value) == (
        "image bytes is not a readable image (not in a format Pillow reads: PNG, JPEG, GIF, WebP, ...)")
    with pytest.raises(ImageError, match="one of 70, 140"):
        process(case_image(8, 8, "RGB"), budget=100)


def test_empty_and_huge_images_are_refused_before_decoding():
    with pytest.raises(ImageError, match="empty"):
        process(Image.new("RGB", (0, 0)))
    # a 10000 x 10000 PNG header: refused from its size, never decoded (100 MP)
    buf = io.BytesIO()
    Image.new("1", (10000, 10000)).save(buf, format="PNG")
    with pytest.raises(ImageError, match="100 MP"):
        process(buf.getvalue())
