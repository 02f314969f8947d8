import io

import numpy as np
import pytest
import torch
from conftest import encoded, hf_processor, photo, varied_images
from PIL import Image

from mmcli.errors import ImageError
from mmcli.inputs.preprocess import ImageProcessorConfig, decode_image, preprocess, smart_resize

QWEN3 = ImageProcessorConfig()  # the released Qwen3-VL preprocessor values


@pytest.mark.parametrize(
    "hw,expected",
    [
        ((1365, 2048), (1376, 2048)),
        ((480, 640), (480, 640)),
        ((1000, 1000), (992, 992)),
        ((1080, 1920), (1088, 1920)),
        ((100, 100), (256, 256)),
        ((8000, 6000), (4704, 3520)),
        ((80, 4000), (64, 4000)),  # half-to-even rounding: 80/32 = 2.5 -> 2
    ],
)
def test_smart_resize_matches_spec_examples(hw, expected):
    assert smart_resize(*hw, 32, QWEN3.min_pixels, QWEN3.max_pixels) == expected


def test_aspect_ratio_over_200_is_an_image_error():
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(10, 2100, 32, QWEN3.min_pixels, QWEN3.max_pixels)


def _decode_bytes(tmp_path, data: bytes, name: str):
    f = tmp_path / name
    f.write_bytes(data)
    return decode_image(f)


@pytest.mark.parametrize("released", [False, True], ids=["checkpoint_limits", "released_limits"])
def test_pixels_and_grids_match_transformers_pil_processor(tiny_dir, tmp_path, released):
    proc = hf_processor(tiny_dir).image_processor
    cfg = ImageProcessorConfig.from_checkpoint(tiny_dir)
    if released:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        proc = Qwen2VLImageProcessorPil(
            size={"shortest_edge": 65536, "longest_edge": 16777216},
            patch_size=16,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
            merge_size=2,
        )
        cfg = QWEN3
    images = varied_images()
    assert len(images) >= 10
    for name, im in images.items():
        decoded = _decode_bytes(
            tmp_path, encoded(im, "PNG" if im.mode != "CMYK" else "TIFF"), name + ".img"
        ).image
        # transformers gets the image as Pillow opened it (its own RGB conversion), except 16-bit
        # grey, whose
        # values Pillow's convert() would clip; there both get our 8-bit scaled decode.
        reference_input = (
            decoded
            if im.mode.startswith("I")
            else Image.open(io.BytesIO(encoded(im, "PNG" if im.mode != "CMYK" else "TIFF")))
        )
        ref = proc(images=[reference_input], return_tensors="pt")
        pixels, grid = preprocess(decoded, cfg)
        assert list(grid) == ref["image_grid_thw"][0].tolist(), name
        torch.testing.assert_close(pixels, ref["pixel_values"], atol=1e-6, rtol=0, msg=name)


def test_exif_orientation_is_applied(tmp_path):
    im = photo("chelsea.jpg", (60, 40))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    f = tmp_path / "rot.jpg"
    im.save(f, exif=exif)
    assert decode_image(f).image.size == (40, 60)


def test_alpha_is_composited_on_white(tmp_path):
    clear = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    out = _decode_bytes(tmp_path, encoded(clear, "PNG"), "a.png").image
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (255, 255, 255)


def test_sixteen_bit_grey_is_scaled_not_clipped(tmp_path):
    arr = np.full((4, 4), 32896, dtype=np.uint16)  # 128 * 257
    out = _decode_bytes(tmp_path, encoded(Image.fromarray(arr), "PNG"), "g16.png").image
    assert out.getpixel((0, 0)) == (128, 128, 128)


def test_animation_uses_first_frame_and_says_so(tmp_path):
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    f = tmp_path / "anim.gif"
    frames[0].save(f, save_all=True, append_images=frames[1:])
    d = decode_image(f)
    assert d.image.getpixel((0, 0)) == (255, 0, 0) and d.note == "first frame of 3 used"


@pytest.mark.parametrize(
    "name,data,cause",
    [
        ("zero.jpg", b"", "empty file"),
        ("text.jpg", b"this is not an image at all\n", "not an image"),
        (
            "trunc.jpg",
            encoded(Image.new("RGB", (64, 64), (1, 2, 3)), "JPEG")[:200],
            "cannot decode",
        ),
    ],
)
def test_bad_files_raise_one_line_image_errors(tmp_path, name, data, cause):
    with pytest.raises(ImageError, match=cause) as e:
        _decode_bytes(tmp_path, data, name)
    assert "\n" not in str(e.value)


def test_decompression_bomb_is_refused_before_decoding(tmp_path):
    f = tmp_path / "bomb.png"
    Image.new("L", (3000, 3000)).save(f)
    with pytest.raises(ImageError, match="decompression bomb"):
        decode_image(f, max_decode_pixels=1_000_000)
