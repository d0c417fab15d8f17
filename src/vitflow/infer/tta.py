"""Test-time augmentation (TTA): a model's probabilities averaged over several views of each image.

Syntax of a TTA spec (``vitflow eval/predict/export --tta SPEC``), comma-separated parts:

- ``flip``: the image and its horizontal mirror (2 views);
- ``crops5``: the four corner crops and the centre crop, each covering ``CROP_FRACTION`` (87.5%) of
  the side of the preprocessed image and resized back to the model's input size (bilinear, as
  in ``FiveCrop``; 5 views);
- ``scales=S1,S2,...``: the image resized to ``round(S * size / patch) * patch`` pixels (the model
  at another input resolution, its position embedding interpolated as in progressive resizing);
  every number after ``scales=`` belongs to it, so put it last: ``flip,scales=0.875,1.0,1.143``.
  PyTorch models only (an exported graph has a fixed input size).
- ``none``: no TTA.

Parts combine as a product: ``flip,crops5`` is ten views (five crops and their mirrors), ``flip,
scales=0.875,1.0`` four. The probabilities (softmax; a sigmoid per class for multi-label models)
of all views are averaged with equal weights. The views of one scale run through the model in a
single forward pass (split in halves on a CUDA out-of-memory error).

:class:`TTAModel` wraps a model so that its output is the *log* of the averaged probabilities
(multi-class; its softmax, argmax and cross-entropy are those of the averaged probabilities) or the
*logit* of the averaged probabilities (multi-label; its sigmoid is the average). The evaluation,
prediction and ONNX export code therefore use it as any model.

References: Krizhevsky et al. 2012 (ten-crop testing); Simonyan & Zisserman 2015 (multi-scale and
flip averaging of softmax outputs).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CROP_FRACTION = 0.875  # crops5: each crop's side as a fraction of the image's side


@dataclass(frozen=True)
class TTASpec:
    """A parsed TTA spec: ``flip`` (mirror views), ``crops5`` (five crops), ``scales`` (input
    resolutions as fractions of the model's; ``(1.0,)`` = the model's own)."""

    flip: bool = False
    crops5: bool = False
    scales: tuple[float, ...] = (1.0,)

    @property
    def enabled(self) -> bool:
        return self.flip or self.crops5 or self.scales != (1.0,)

    @property
    def views(self) -> int:
        """Number of views per image (forward passes' worth of images)."""
        return (2 if self.flip else 1) * (5 if self.crops5 else 1) * len(self.scales)

    def __str__(self) -> str:
        parts = (["flip"] if self.flip else []) + (["crops5"] if self.crops5 else [])
        if self.scales != (1.0,):
            parts.append("scales=" + ",".join(f"{s:g}" for s in self.scales))
        return ",".join(parts) or "none"


PARTS = ("flip", "crops5", "scales", "none")  # the words of a spec (scales takes =S1,S2,...)


def tta_where(spec: object, flag: str = "--tta") -> str:
    """How a message names the setting: ``--tta flp`` on the command line (``flag="--tta"``),
    ``tta='flp'`` from Python (``flag="tta="``)."""
    return f"{flag} {spec}" if flag.startswith("--") else f"{flag}{spec!r}"


def parse_tta(spec: str | TTASpec | None, flag: str = "--tta") -> TTASpec:
    """Parse ``flip``, ``crops5``, ``scales=0.875,1.0,1.143`` (or ``scales:...``), comma-joined, or
    ``none`` / ``None``. ``flag`` names the setting in messages (:func:`tta_where`).

    Raises:
        ValueError: an unknown part (with the nearest spec: ``did you mean 'flip'?``), a scale
            that is not a number > 0, a repeated part, or numbers that follow no ``scales=``; one
            line naming the spec.
    """
    if isinstance(spec, TTASpec):
        return spec
    where = tta_where(spec, flag)
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"{where} is not a TTA spec: give text such as 'flip' or 'flip,crops5' (or None)")
    if spec is None or spec.strip().lower() in ("", "none"):
        return TTASpec()
    flip = crops5 = False
    scales: list[float] | None = None
    in_scales = False
    for raw in spec.split(","):
        part = raw.strip().lower()
        head, sep, value = part.replace(":", "=", 1).partition("=")
        if sep and head == "scales" and scales is None:
            scales, in_scales, part = [], True, value
            if not part:
                continue
        if in_scales and _number(part) is not None:
            if _number(part) <= 0:
                raise ValueError(f"{where}: scale {part} is not > 0")
            scales.append(_number(part))
        elif part in ("flip", "crops5") and not (flip if part == "flip" else crops5):
            flip, crops5, in_scales = flip or part == "flip", crops5 or part == "crops5", False
        elif part in ("flip", "crops5"):
            raise ValueError(f"{where}: {part!r} is there twice; give each part once")
        else:
            raise ValueError(f"{where}: cannot read {raw.strip()!r}: expected flip, crops5, scales=S1,S2,... "
                             f"(numbers > 0, last) or none, comma-separated{_did_you_mean(spec, raw)}")
    if scales == []:
        raise ValueError(f"{where}: scales= needs at least one number, e.g. scales=0.875,1.0,1.143")
    return TTASpec(flip, crops5, tuple(scales) if scales else (1.0,))


def _did_you_mean(spec: str, raw: str) -> str:
    """``; did you mean 'SPEC'?``: ``spec`` with the unreadable part ``raw`` replaced by the nearest
    word of :data:`PARTS` (``flp`` -> ``flip``, ``scale=0.9`` -> ``scales=0.9``), or ``""``."""
    head, sep, value = raw.strip().lower().replace(":", "=", 1).partition("=")
    close = difflib.get_close_matches(head, PARTS, n=1, cutoff=0.6)
    if not close or close[0] == head:
        return ""
    fixed = close[0] + (f"={value}" if sep and close[0] == "scales" else "")
    parts = [p.strip() for p in spec.split(",")]
    parts[parts.index(raw.strip())] = fixed
    return f"; did you mean {','.join(parts)!r}?"


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def five_crops(x: torch.Tensor, fraction: float = CROP_FRACTION) -> torch.Tensor:
    """``(B, C, H, W)`` -> ``(5 * B, C, H, W)``: the top-left, top-right, bottom-left, bottom-right
    and centre crops of ``round(fraction * H) x round(fraction * W)`` pixels, each resized back to
    ``H x W`` (bilinear, no antialiasing: it enlarges), in that order, crop-major."""
    h, w = x.shape[-2:]
    ch, cw = max(1, round(fraction * h)), max(1, round(fraction * w))
    tops = (0, 0, h - ch, h - ch, (h - ch) // 2)
    lefts = (0, w - cw, 0, w - cw, (w - cw) // 2)
    crops = [x[..., t:t + ch, s:s + cw] for t, s in zip(tops, lefts)]
    return F.interpolate(torch.cat(crops), size=(h, w), mode="bilinear", align_corners=False)


def views(x: torch.Tensor, spec: TTASpec, scale: float = 1.0, patch: int = 1) -> torch.Tensor:
    """The views of one scale: ``(B, C, S, S)`` -> ``(V * B, C, S', S')`` with ``V`` = 5 (crops5) x 2
    (flip), view-major (rows ``v * B .. v * B + B - 1`` are view ``v`` of the batch); ``S'`` =
    ``round(scale * S / patch) * patch`` (at least one patch)."""
    if scale != 1.0:
        size = max(patch, round(scale * x.shape[-1] / patch) * patch)
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=scale < 1)
    if spec.crops5:
        x = five_crops(x)
    if spec.flip:
        x = torch.cat([x, x.flip(-1)])
    return x


class TTAModel(torch.nn.Module):
    """``model`` with test-time augmentation: ``forward(x)`` takes the model's normalised input
    ``float (B, 3, S, S)`` and returns ``float32 (B, num_classes)``: ``log(mean_v softmax(z_v))``
    (multi-class) or ``logit(mean_v sigmoid(z_v))`` (multi-label), computed from log-softmax /
    log-sigmoid with ``logsumexp`` so it stays finite for any logits. With no TTA it returns the
    model's logits unchanged.

    Args:
        model: a vitflow model (or :class:`~vitflow.infer.runtimes.onnx.OnnxModel`; no ``scales``).
        spec: a :class:`TTASpec` or its text (:func:`parse_tta`).
        task: ``multiclass`` or ``multilabel``.
    Raises:
        ValueError: a bad spec (see :func:`parse_tta`), an unknown task.
    """

    def __init__(self, model: torch.nn.Module, spec: str | TTASpec, task: str = "multiclass"):
        super().__init__()
        if task not in ("multiclass", "multilabel"):
            raise ValueError(f"unknown task {task!r}; expected multiclass or multilabel")
        self.model, self.spec, self.task = model, parse_tta(spec), task
        self.patch = int(getattr(model, "patch_size", 1) or 1)

    @property
    def blocks(self):  # the export code rewrites the wrapped model's attention blocks
        return self.model.blocks

    @property
    def embed_dim(self) -> int:
        return self.model.embed_dim

    def _forward_views(self, x: torch.Tensor) -> torch.Tensor:
        """The model on ``x``; on a CUDA out-of-memory error, on each half (recursively)."""
        try:
            return self.model(x).float()
        except torch.cuda.OutOfMemoryError:
            if len(x) == 1:
                raise
            torch.cuda.empty_cache()
            half = len(x) // 2
            return torch.cat([self._forward_views(x[:half]), self._forward_views(x[half:])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.spec.enabled:
            return self.model(x)
        b, terms = x.shape[0], []
        for scale in self.spec.scales:
            z = self._forward_views(views(x, self.spec, scale, self.patch))
            terms.append(z.reshape(-1, b, z.shape[-1]))
        z = torch.cat(terms)  # (V, B, C)
        log_v = math.log(z.shape[0])
        if self.task == "multilabel":
            log_p = torch.logsumexp(F.logsigmoid(z), dim=0) - log_v
            log_q = torch.logsumexp(F.logsigmoid(-z), dim=0) - log_v
            return log_p - log_q
        return torch.logsumexp(F.log_softmax(z, dim=-1), dim=0) - log_v


def with_tta(model: torch.nn.Module, spec: str | TTASpec | None, task: str = "multiclass") -> torch.nn.Module:
    """``model`` wrapped in :class:`TTAModel` when ``spec`` asks for any augmentation, else
    ``model`` itself. Raises ValueError for a bad spec."""
    parsed = parse_tta(spec)
    return TTAModel(model, parsed, task) if parsed.enabled else model


def tta_probs(model: torch.nn.Module, images: torch.Tensor, spec: str | TTASpec, task: str = "multiclass"
              ) -> torch.Tensor:
    """Averaged probabilities of ``model`` over the views of ``spec``: normalised ``float (B, 3, S, S)``
    -> ``float32 (B, C)`` (rows sum to 1 for ``multiclass``; each in [0, 1] for ``multilabel``)."""
    out = TTAModel(model, spec, task)(images).float()
    return out.sigmoid() if task == "multilabel" else out.softmax(dim=-1)


tta_logits = tta_probs  # the name in INTERFACES.md (it returns probabilities)


def check_export_tta(spec: str | TTASpec | None, fmt: str, flag: str = "--tta") -> TTASpec:
    """Check that an export to ``fmt`` can hold ``spec``'s views in its graph: only ONNX records them
    (in its metadata), and only flip / crops5 (an export has one input size). ``flag`` names the
    settings in messages: ``--tta`` / ``--format`` on the command line, ``tta=`` / ``format=`` from
    Python (:func:`tta_where`).

    Raises:
        ValueError: a bad spec, ``scales``, or a format other than ``onnx``; one line naming both.
    """
    parsed = parse_tta(spec, flag)
    if not parsed.enabled:
        return parsed
    where = tta_where(spec, flag)
    fmt_where = f"--format {fmt}" if flag.startswith("--") else f"format={fmt!r}"
    onnx = "--format onnx" if flag.startswith("--") else "format='onnx'"
    if fmt != "onnx":
        raise ValueError(f"{where} goes with {onnx} (its metadata records the views), not {fmt_where}: "
                         "that export holds the plain model")
    if parsed.scales != (1.0,):
        raise ValueError(f"{where}: an export has one input size; use flip and/or crops5")
    return parsed


def tta_for_export(model: torch.nn.Module, spec: str | TTASpec | None, info, fmt: str) -> torch.nn.Module:
    """``model`` with ``spec``'s views averaged inside the exported graph (``vitflow export --tta``),
    ``info.tta`` (:class:`~vitflow.infer.runtimes.onnx.ModelInfo`) set to record it in the file's
    metadata; ``model`` itself without TTA. The graph's input and output keep their names and shapes;
    the output becomes :class:`TTAModel`'s (log / logit of the averaged probabilities).

    Raises:
        ValueError: a bad spec, ``scales`` (an export has one input size), or a format other than
            ``onnx`` (only its metadata records the TTA).
    """
    parsed = check_export_tta(spec, fmt)
    if not parsed.enabled:
        return model
    info.tta = str(parsed)
    return TTAModel(model, parsed, info.task)
