"""Image decoding: encoded bytes -> ``uint8`` RGB tensor ``(3, H, W)``.

Upright JPEGs go through simplejpeg (libjpeg-turbo, optionally at a reduced DCT scale); rotated
or CMYK JPEGs, PNG, WebP and GIF through ``torchvision.io.decode_image`` (libjpeg-turbo / libpng,
EXIF orientation applied); every other format Pillow reads (BMP, TIFF, PPM, ...) through Pillow
with ``ImageOps.exif_transpose``. Grayscale, CMYK, palette, RGBA and 16-bit images all
come out as 8-bit RGB (alpha dropped). The same function serves training, evaluation and
prediction, so orientation and colour handling never differ between them.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import simplejpeg
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
DCT_FACTORS = (8, 4, 2, 1)  # libjpeg-turbo's reduced-size IDCT: decode at 1/8, 1/4, 1/2 or full size


class JpegHeader(NamedTuple):
    width: int
    height: int
    components: int  # 1 gray, 3 YCbCr, 4 CMYK / YCCK
    orientation: int  # EXIF orientation tag (1 = upright; 0 = none)


def _exif_orientation(seg: bytes) -> int:
    """The orientation tag (0x0112) of an APP1 ``Exif`` segment body, 0 when absent or unreadable."""
    if not seg.startswith(b"Exif\0\0") or len(seg) < 14:
        return 0
    tiff = seg[6:]
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None:
        return 0
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 0
    for e in range(int.from_bytes(tiff[ifd:ifd + 2], order)):
        entry = tiff[ifd + 2 + 12 * e:ifd + 14 + 12 * e]
        if len(entry) == 12 and int.from_bytes(entry[:2], order) == 0x0112:
            return int.from_bytes(entry[8:10], order)
    return 0


def jpeg_header(data: bytes) -> JpegHeader | None:
    """Size, colour components and EXIF orientation from a JPEG's markers (no decoding), or
    ``None`` when ``data`` is not a JPEG whose frame header can be found."""
    if not data.startswith(b"\xff\xd8"):
        return None
    i, n, orientation = 2, len(data), 0
    while i + 9 < n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if marker in _SOF:
            return JpegHeader(int.from_bytes(data[i + 7:i + 9], "big"), int.from_bytes(data[i + 5:i + 7], "big"),
                              data[i + 9], orientation)
        if marker == 0xE1 and not orientation:
            orientation = _exif_orientation(data[i + 4:i + 2 + length])
        i += 2 + length
    return None


def _header_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` read directly from a JPEG SOF or PNG IHDR header, else ``None``."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    hdr = jpeg_header(data)
    return None if hdr is None else (hdr.width, hdr.height)


def _reducible(hdr: JpegHeader | None) -> bool:
    return hdr is not None and hdr.components in (1, 3) and hdr.orientation <= 1


def reducible_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` when :func:`decode_image` may decode ``data`` at a reduced size (an
    upright gray or YCbCr JPEG), else ``None``."""
    hdr = jpeg_header(data)
    return (hdr.width, hdr.height) if _reducible(hdr) else None


def dct_factor(size: tuple[int, int], min_size: tuple[int, int] | None) -> int:
    """The largest libjpeg-turbo reduction (8, 4, 2 or 1) that keeps an image of ``size``
    ``(w, h)`` at least ``min_size`` ``(w, h)`` on both sides (1 when ``min_size`` is None)."""
    if min_size is None:
        return 1
    return next(f for f in DCT_FACTORS if f == 1 or (size[0] // f >= min_size[0] and size[1] // f >= min_size[1]))


def _check_pixels(path: str, width: int, height: int) -> None:
    limit = Image.MAX_IMAGE_PIXELS
    if limit and width * height > limit:
        raise CorruptImageError(path, f"over the decompression-bomb limit ({width}x{height} pixels > {limit})")


def image_size(data: bytes, path: str = "<bytes>") -> tuple[int, int]:
    """``(width, height)`` from the header only (JPEG and PNG parsed directly, other formats by
    Pillow).

    Raises:
        CorruptImageError: not an image, or more pixels than Pillow's ``MAX_IMAGE_PIXELS``
            (the decompression-bomb limit).
    """
    size = _header_size(data)
    if size is not None:
        _check_pixels(path, *size)
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


def decode_image(data: bytes, path: str = "<bytes>", min_size: tuple[int, int] | None = None) -> torch.Tensor:
    """Decode ``data`` to an RGB ``uint8`` tensor ``(3, H, W)`` with EXIF orientation applied.

    Upright gray / YCbCr JPEGs go through simplejpeg (libjpeg-turbo's TurboJPEG API, ~18% faster
    here than ``torchvision.io.decode_jpeg`` on ImageNet photos); with ``min_size`` ``(w, h)``
    they may be decoded at 1/2, 1/4 or 1/8 size in the DCT domain (:func:`dct_factor`) while both
    sides stay at least ``min_size`` — the reduced-size decode of PIL's ``draft``. Everything else
    (EXIF-rotated or CMYK JPEGs, PNG, WebP, GIF) goes through ``torchvision.io.decode_image``,
    other formats through Pillow.

    Raises:
        CorruptImageError: empty, truncated, not an image, or over the decompression-bomb limit.
    """
    if not data:
        raise CorruptImageError(path, "empty file (0 bytes)")
    hdr = jpeg_header(data)
    if _reducible(hdr):
        _check_pixels(path, hdr.width, hdr.height)
        f = dct_factor((hdr.width, hdr.height), min_size)
        try:
            arr = simplejpeg.decode_jpeg(data, "RGB", min_factor=f, min_height=-(-hdr.height // f),
                                         min_width=-(-hdr.width // f))
            return torch.from_numpy(arr).permute(2, 0, 1)
        except ValueError:  # truncated or unusual: the general path below decides and names the problem
            pass
    image_size(data, path)  # header check: rejects non-images and decompression bombs cheaply
    try:
        if data.startswith(_TV_MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
            img = _tv_decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB,
                             apply_exif_orientation=True)
            if img.dtype == torch.uint16:  # 16-bit PNG
                img = (img.to(torch.int32) >> 8).to(torch.uint8)
            return img
        with Image.open(io.BytesIO(data)) as im:
            return pil_to_tensor(im)
    except CorruptImageError:
        raise
    except Exception as e:
        msg = str(e)
        if ".cpp:" in msg:  # torchvision prefixes its C++ source location: "decode_jpeg, /.../x.cpp:171, <reason>"
            msg = msg.split(".cpp:")[-1].split(", ", 1)[-1]
        raise CorruptImageError(path, f"{type(e).__name__}: {msg}") from None


def pil_to_tensor(im: Image.Image) -> torch.Tensor:
    """A Pillow image as ``uint8 (3, H, W)`` RGB, EXIF orientation applied (``ImageOps.exif_transpose``),
    16-bit gray scaled to 8 bits, alpha dropped: what :func:`decode_image` gives for the file."""
    im = ImageOps.exif_transpose(im)
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        im = im.point(lambda v: v / 256).convert("L")
    rgb = im.convert("RGB")
    return torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(rgb.height, rgb.width, 3).permute(
        2, 0, 1).contiguous()


def as_image(obj, name: str = "image") -> torch.Tensor:
    """An image held in Python as ``uint8 (3, H, W)`` RGB: a Pillow image (:func:`pil_to_tensor`), a
    ``uint8`` NumPy array ``(H, W)``, ``(H, W, C)`` or ``(C, H, W)``, a ``uint8`` tensor ``(H, W)``,
    ``(C, H, W)`` or ``(H, W, C)`` (C = 1, 3 or 4; gray repeated, alpha dropped; NumPy arrays read as
    ``(H, W, C)`` and tensors as ``(C, H, W)`` when both fit), or a path / bytes of an encoded file
    (:func:`decode_image`).

    Raises:
        CorruptImageError: a file that cannot be read or decoded. TypeError: anything else,
            a float image included (one line naming ``name``: vitflow takes 0-255 ``uint8`` pixels and
            normalises on the device).
    """
    if isinstance(obj, Image.Image):
        return pil_to_tensor(obj)
    if isinstance(obj, (str, os.PathLike)):
        try:
            return decode_image(Path(obj).read_bytes(), str(obj))
        except OSError as e:
            raise CorruptImageError(str(obj), f"cannot read: {e}") from None
    if isinstance(obj, (bytes, bytearray)):
        return decode_image(bytes(obj), name)
    is_array = isinstance(obj, np.ndarray)
    if not (is_array or isinstance(obj, torch.Tensor)):
        raise TypeError(f"{name} is a {type(obj).__name__}: expected a PIL image, a uint8 array or tensor, or a path")
    if obj.dtype not in (np.uint8, torch.uint8):
        raise TypeError(f"{name} is a {str(obj.dtype).removeprefix('torch.')} {'array' if is_array else 'tensor'}: "
                        "vitflow takes uint8 images (0-255; it normalises on the device): leave ToTensor / Normalize "
                        "out of the transform")
    t = torch.from_numpy(np.ascontiguousarray(obj)) if is_array else obj.detach().cpu()
    if t.ndim == 2:
        t = t[None]
    elif t.ndim == 3 and t.shape[-1] in (1, 3, 4) and (is_array or t.shape[0] not in (1, 3, 4)):
        t = t.permute(2, 0, 1)
    if t.ndim != 3 or t.shape[0] not in (1, 3, 4):
        raise TypeError(f"{name} has shape {tuple(obj.shape)}: expected (H, W), (H, W, C) or (C, H, W) with C 1, 3 or 4")
    return (t.expand(3, -1, -1) if t.shape[0] == 1 else t[:3]).contiguous()
