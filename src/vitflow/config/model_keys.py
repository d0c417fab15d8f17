"""Model keys across families: which class holds a key, what an old flat ``model`` section held,
and moving a ``model`` section to another family's class.

Until the per-family sections (vitflow 892fe07 and before), ``model`` was one flat section of 25
keys, ViT-shaped, and every checkpoint and run folder stores it so (``config.model`` and
``model_args``). :data:`LEGACY_MODEL_DEFAULTS` is that section's defaults, frozen: a key a family
lacks is dropped from such a section when it holds its old default (the old code refused any
other value for those families, or ignored the key: the attention backends' options), so old
checkpoints and run folders load unchanged; anything else is refused with one line.
"""

from __future__ import annotations

import dataclasses
import typing
from types import MappingProxyType
from typing import Any

from vitflow.config.checks import ConfigError
from vitflow.config.coerce import coerce
from vitflow.config.model_schema import ModelConfig, model_config_classes

# the flat ModelConfig of vitflow 892fe07: key -> default (frozen; never edit)
LEGACY_MODEL_DEFAULTS = MappingProxyType({
    "name": "vit_digits_patch2_8", "pretrained": None, "img_size": None, "num_classes": None, "embed_dim": None,
    "depth": None, "num_heads": None, "mlp_ratio": None, "patch_size": None, "global_pool": None, "attention": "sdpa",
    "attn_block_size": 128, "attn_window": 3, "linformer_k": None, "performer_features": None, "pos_embed": "learned",
    "layer_scale_init": None, "drop_rate": 0.0, "drop_path_rate": 0.0, "patch_drop_rate": 0.0, "weight_init": "timm",
    "cpu_bf16_matmul": "auto", "grad_checkpointing": "none", "grad_checkpointing_budget": None, "distilled": False,
})
# options of attention backends: without the backend (a family that has no such key) they do nothing, and the
# old code ignored them whatever their value
BACKEND_OPTIONS = frozenset({"attn_block_size", "attn_window", "linformer_k", "performer_features"})
# pos_embed values the old code took from a Swin / BEiT as "the family's own encoding"
_OWN_POS_EMBED = ("learned", "relative")


def field_names(cls: type[ModelConfig]) -> list[str]:
    """The keys of a model section class, in order."""
    return [f.name for f in dataclasses.fields(cls)]


def model_key_defaults() -> dict[str, Any]:
    """Every model key any family (or the old flat section) has -> its default (the same in every
    class that has it)."""
    out = dict(LEGACY_MODEL_DEFAULTS)
    for cls in model_config_classes():
        out.update({f.name: f.default for f in dataclasses.fields(cls)})
    return out


def is_model_key(leaf: str) -> bool:
    """Whether ``leaf`` is a key of some family's model section (or of the old flat one)."""
    return leaf in model_key_defaults()


def holds_old_default(leaf: str, value: Any) -> bool:
    """Whether a key a family lacks may be dropped from an old (or another family's) section:
    it holds its default, is an attention backend's option, or names a family's own position
    encoding (see the module text)."""
    if leaf in BACKEND_OPTIONS or (leaf == "pos_embed" and value in _OWN_POS_EMBED):
        return True
    defaults = model_key_defaults()
    return leaf in defaults and _same(value, defaults[leaf])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def not_a_key(leaf: str, cls: type[ModelConfig], name: str, value: Any = dataclasses.MISSING) -> ConfigError:
    """The one-line refusal of ``model.LEAF`` for a section of ``cls`` (naming the model and the
    keys the section takes)."""
    shown = "" if value is dataclasses.MISSING else f"={value!r}"
    auto = " (model.name=auto: the weights' config could not be read without the network; name the model or give " \
        "a snapshot folder)" if name == "auto" else ""
    return ConfigError(f"model.{leaf}{shown} is not a key of {cls.label} models (model.name={name}); their keys: "
                       f"{', '.join(field_names(cls))}{auto}", f"model.{leaf}")


def retype_model(m: ModelConfig, cls: type[ModelConfig]) -> ModelConfig:
    """``m`` as a ``cls`` section: the keys both have carried over (coerced to ``cls``'s types,
    which may be narrower: a Swin's ``attention`` takes no ``local``), the keys ``cls`` lacks dropped
    when they hold their defaults (:func:`holds_old_default`). ``m`` itself when it is one already.

    Raises:
        ConfigError: a key ``cls`` lacks with a value of its own, or a value ``cls`` does not take
            (one line naming the key).
    """
    if type(m) is cls:
        return m
    out, hints, keys = cls(), typing.get_type_hints(cls), field_names(cls)
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if f.name in keys:
            setattr(out, f.name, coerce(value, hints[f.name], f"model.{f.name}"))
        elif not holds_old_default(f.name, value):
            raise not_a_key(f.name, cls, m.name, value)
    out.validate()
    return out
