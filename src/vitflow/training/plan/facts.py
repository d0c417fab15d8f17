"""What the plan's rules know of a run besides its values (:class:`Facts`), the data's profile
they start from (:class:`DataProfile`), and the model input size as the run stands (:func:`input_size`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vitflow.models import model_kwargs
from vitflow.training.plan.clock import Clock

Values = dict[str, Any]  # dotted key -> the run's value as it stands


@dataclass(frozen=True)
class DataProfile:
    """What the plan needs to know of the data: the training split's ``images``, ``classes``, the
    median ``short_side`` / ``long_side`` in pixels of a sample of images (``recipe.SAMPLE``) and
    whether they all have one size (``uniform``), and the images of the validation and test
    splits the run evaluates (``val_images``, ``test_images``)."""

    images: int
    classes: int
    short_side: int
    long_side: int
    uniform: bool = False
    val_images: int = 0
    test_images: int = 0


@dataclass(frozen=True)
class Facts:
    """What the rules know besides the values: the training split (``images``, ``classes``, the
    median ``short_side`` in pixels, and whether every sampled image has one size ``uniform``),
    the device kind (``cpu`` / ``cuda``), the family of a model the user named (``vit`` otherwise),
    the pretrained source's architecture (``source``: ``(origin, model name, model kwargs)``; the
    name ``None`` for bare weights without a ``model.name``) for a fine-tune, the evaluated images
    (``eval_images``: the split monitored during training, ``final_images``: every split evaluated
    at the end, ``val_images``: the validation split's, 0 without one), the measured :class:`~vitflow.training.plan.clock.Clock` (phase 1),
    the keys the user set and the model the user named (``named``: its ``model.name``, whose
    architecture the plan keeps)."""

    images: int
    classes: int
    short_side: int
    uniform: bool = False
    device: str = "cpu"
    family: str = "vit"
    source: tuple[str, str, dict[str, Any]] | None = None
    eval_images: int = 0
    final_images: int = 0
    val_images: int = 0
    clock: Clock | None = None
    user: frozenset[str] = field(default_factory=frozenset)
    named: str | None = None

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def scratch_vit(self) -> bool:
        """A plain ViT trained from scratch."""
        return self.source is None and self.family == "vit"

    @property
    def plans_architecture(self) -> bool:
        """A ViT from scratch whose model the user did not name: its input size, patch size, model
        and pooling are the plan's to choose (a named model keeps its name's)."""
        return self.scratch_vit and self.named is None


def input_size(f: Facts, v: Values) -> int | None:
    """The model's input size in pixels as the run stands: ``model.img_size``, else the named
    model's own (``None`` when neither is known)."""
    return v["model.img_size"] or (model_kwargs(f.named).get("img_size") if f.named else None)
