"""What a planned run holds out of the training images where the data has no validation split
(a train / test folder, CIFAR's tar) or neither split (class folders alone): the slices' keys
(:func:`held_out_keys`), how many (:func:`held_out_count`) and the data's profile after them
(:func:`hold_out`)."""

from __future__ import annotations

import dataclasses

from vitflow.config import DataConfig
from vitflow.data.sources.dispatch import resolve_eval_splits
from vitflow.data.sources.splits import parse_split
from vitflow.training.plan.facts import DataProfile

HELD_OUT, MAX_HELD_OUT, MIN_HOLDING = 0.1, 2000, 300  # data without a validation split: the share held out of train


def hold_out(profile: DataProfile, d: DataConfig, user: set[str]) -> tuple[list[tuple[str, str, str]], DataProfile]:
    """The held-out slices' ``(key, value, why)`` (:func:`held_out_count`, :func:`held_out_keys`)
    and the data's profile after them.

    Raises:
        DataError: no validation or test split and too few images to hold any out (the data's
            message, before any timing).
    """
    held = held_out_count(profile, d, user)
    test = bool(held) and not profile.test_images and "data.test_split" not in user  # no test split either
    if not (held or profile.val_images or profile.test_images):
        resolve_eval_splits(d)
    keys = held_out_keys(d.train_split, held, profile.images, test) if held else []
    return keys, dataclasses.replace(profile, images=profile.images - held * (1 + test),
                                      val_images=profile.val_images + held,
                                      test_images=profile.test_images + held * test)


def held_out_count(profile: DataProfile, d: DataConfig, user: set[str]) -> int:
    """Training images to hold out as the validation split (and as many again as the test split
    where the data has none either, :func:`held_out_keys`): :data:`HELD_OUT` of them (at most
    :data:`MAX_HELD_OUT`) when the data has no validation split and :data:`MIN_HOLDING` training
    images or more, so that checkpoints, early stopping and the race are chosen on them, never on
    the test split; 0 when the user set ``data.train_split`` or ``data.val_split``, or the training
    split is already a slice."""
    if (profile.val_images or profile.images < MIN_HOLDING or {"data.train_split", "data.val_split"} & user
            or parse_split(d.train_split).sliced):
        return 0
    return min(MAX_HELD_OUT, round(profile.images * HELD_OUT))


def held_out_keys(train_split: str, k: int, images: int, test: bool = False) -> list[tuple[str, str, str]]:
    """``(key, value, why)`` of the slices holding the last ``k`` of the ``images`` of
    ``train_split`` out as the validation split (a slice is a fixed pseudo-random draw: each class
    in about its share); with ``test`` (data with neither split: a folder of class folders) the
    last ``k`` are the test split the finished model is scored on and the ``k`` before them the
    validation split."""
    name = train_split.strip()
    if not test:
        why = (f"the data has no validation split: {k} of the {images} training images held out as one (its "
               "evaluations; the best checkpoint and the race choose on them where the run has them), never a "
               "test split")
        return [("data.train_split", f"{name}[:-{k}]", f"the training images but the {k} held out"),
                ("data.val_split", f"{name}[-{k}:]", why)]
    why = (f"the data has no validation or test split: {k} of the {images} images held out as the validation "
           "split (its evaluations; the best checkpoint and the race choose on them where the run has them)")
    return [("data.train_split", f"{name}[:-{2 * k}]", f"the images but the {2 * k} held out"),
            ("data.val_split", f"{name}[-{2 * k}:-{k}]", why),
            ("data.test_split", f"{name}[-{k}:]", f"{k} more held out, never chosen on: the finished model's score")]
