"""Image decoding: encoded bytes -> ``uint8`` RGB tensor ``(3, H, W)``.

JPEG, PNG, WebP and GIF go through ``torchvision.io.decode_image`` (libjpeg-turbo / libpng,
EXIF orientation applied); every other format Pillow reads (BMP, TIFF, PPM, ...) goes through
Pillow with ``ImageOps.exif_transpose``. Grayscale, CMYK, palette, RGBA and 16-bit images all
come out as 8-bit RGB (alpha dropped). The same function serves training, evaluation and
prediction, so orientation and colour handling never differ between them.
"""

from __future__ import annotations

import io
import warnings

import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.io import ImageReadMode
from torchvision.io import decode_image as _tv_decode

# torchvision 0.29 flags its image codecs as deprecated in favour of TorchCodec; they remain the
# fastest well-kept JPEG/PNG decoders installable with pip alone, so the notice is silenced here.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm")
_TV_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a")


class CorruptImageError(ValueError):
    """An image file cannot be decoded; ``path`` names it and ``reason`` says why."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"cannot decode image {path}: {reason}")
        self.path, self.reason = path, reason


def is_image_name(name: str) -> bool:
    """True when ``name`` has an image extension (case-insensitive)."""
    return name.lower().endswith(IMAGE_EXTENSIONS)


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _header_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` read directly from a JPEG SOF or PNG IHDR header, else ``None``."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data.startswith(b"\xff\xd8"):
        i, n = 2, len(data)
        while i + 9 < n and data[i] == 0xFF:
            marker = data[i + 1]
            if marker in _SOF:
                return int.from_bytes(data[i + 7:i + 9], "big"), int.from_bytes(data[i + 5:i + 7], "big")
            if marker == 0xFF:  # fill byte
                i += 1
                continue
            i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return None


def image_size(data: bytes, path: str = "<bytes>") -> tuple[int, int]:
    """``(width, height)`` from the header only (JPEG and PNG parsed directly, other formats by
    Pillow).

    Raises:
        CorruptImageError: not an image, or more pixels than Pillow's ``MAX_IMAGE_PIXELS``
            (the decompression-bomb limit).
    """
    size = _header_size(data)
    if size is not None:
        limit = Image.MAX_IMAGE_PIXELS
        if limit and size[0] * size[1] > limit:
            raise CorruptImageError(path, f"over the decompression-bomb limit ({size[0]}x{size[1]} pixels > {limit})")
        return size
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                return im.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise CorruptImageError(path, f"over the decompression-bomb limit ({e})") from None
    except UnidentifiedImageError:
        raise CorruptImageError(path, "not a readable image (unrecognised format)") from None
    except Exception as e:
        raise CorruptImageError(path, f"not a readable image ({type(e).__name__}: {e})") from None


def decode_image(data: bytes, path: str = "<bytes>") -> torch.Tensor:
    """Decode ``data`` to an RGB ``uint8`` tensor ``(3, H, W)`` with EXIF orientation applied.

    Raises:
        CorruptImageError: empty, truncated, not an image, or over the decompression-bomb limit.
    """
    if not data:
        raise CorruptImageError(path, "empty file (0 bytes)")
    image_size(data, path)  # header check: rejects non-images and decompression bombs cheaply
    try:
        if data.startswith(_TV_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
            img = _tv_decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB,
                             apply_exif_orientation=True)
            if img.dtype == torch.uint16:  # 16-bit PNG
                img = (img.to(torch.int32) >> 8).to(torch.uint8)
            return img
        with Image.open(io.BytesIO(data)) as im:
            im = ImageOps.exif_transpose(im)
            if im.mode in ("I;16", "I;16B", "I;16L", "I"):
                im = im.point(lambda v: v / 256).convert("L")
            rgb = im.convert("RGB")
        return torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(rgb.height, rgb.width, 3).permute(
            2, 0, 1).contiguous()
    except CorruptImageError:
        raise
    except Exception as e:
        raise CorruptImageError(path, f"{type(e).__name__}: {e}") from None
