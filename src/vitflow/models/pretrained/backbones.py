"""``model.pretrained=auto``: a pretrained backbone whenever one can be had, for a planned run on a
photo folder (fastai's ``vision_learner``, Keras' and Hugging Face's image-classification
tutorials all start from one: on a few thousand photos a backbone pretrained on ImageNet is the
usual start, not training from scratch).

:data:`BACKBONES` lists the backbones vitflow reads from the Hugging Face hub, smallest first; on a
CPU the plan takes them in that order, on a GPU the strongest first. :func:`choose_backbone` looks
for one in the local Hugging Face cache (no network), then, when the hub answers within
:data:`PROBE_S` seconds (``HF_ENDPOINT`` honoured, ``HF_HUB_OFFLINE=1`` respected), downloads the
first; else it returns ``None`` and why, and the plan trains from scratch after one line saying
how to get one. The hub's answer is asked once per process.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vitflow.models.pretrained.hub import hub_cache_dir, hub_offline, hub_snapshot

PROBE_S = 3.0  # seconds the hub has to answer before the plan goes on without it
DEFAULT_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True)
class Backbone:
    """One pretrained backbone: its hub repository (``timm/NAME.TAG``), the vitflow variant it
    builds, its forward GFLOPs at the input size of its weights and what it was trained on."""

    hub: str
    name: str
    gflops: float
    what: str


BACKBONES: tuple[Backbone, ...] = (
    Backbone("timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k", "vit_tiny_patch16_224", 1.3,
             "ViT-Ti/16, ImageNet-21k then ImageNet-1k with AugReg (Steiner et al. 2022)"),
    Backbone("timm/deit3_small_patch16_224.fb_in22k_ft_in1k", "deit3_small_patch16_224", 4.6,
             "DeiT III-S/16, ImageNet-21k then ImageNet-1k (Touvron et al. 2022)"),
    Backbone("timm/vit_small_patch16_224.augreg_in21k_ft_in1k", "vit_small_patch16_224", 4.6,
             "ViT-S/16, ImageNet-21k then ImageNet-1k with AugReg (Steiner et al. 2022)"),
    Backbone("timm/mvitv2_tiny.fb_in1k", "mvitv2_tiny", 4.7, "MViTv2-T, ImageNet-1k (Li et al. 2022)"),
    Backbone("timm/vit_small_patch14_dinov2.lvd142m", "vit_small_patch14_dinov2", 46.8,
             "DINOv2 ViT-S/14, self-supervised on LVD-142M (Oquab et al. 2023)"),
)

_REACHABLE: dict[str, bool] = {}  # endpoint -> whether it answered: asked once per process


def endpoint() -> str:
    """The hub's address: ``$HF_ENDPOINT``, else ``https://huggingface.co``."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def hub_reachable(url: str | None = None, timeout: float = PROBE_S) -> bool:
    """Whether the hub at ``url`` (default :func:`endpoint`) answers an HTTP request within
    ``timeout`` seconds (any status: a server that answers is there); ``False`` at once under
    ``HF_HUB_OFFLINE=1``. Asked once per process and address."""
    url = url or endpoint()
    if hub_offline():
        return False
    if url not in _REACHABLE:
        try:
            urllib.request.urlopen(urllib.request.Request(f"{url}/api/models/{BACKBONES[0].hub}", method="HEAD"),
                                   timeout=timeout).close()
            _REACHABLE[url] = True
        except urllib.error.HTTPError:
            _REACHABLE[url] = True  # it answered, with an error status
        except (OSError, ValueError):
            _REACHABLE[url] = False
    return _REACHABLE[url]


def candidates(device: str, name: str | None = None) -> list[Backbone]:
    """The backbones in the order the plan tries them on ``device`` (``cpu`` / ``cuda``): the
    smallest first on a CPU, the strongest first on a GPU; only those building ``name`` when the
    user named a model."""
    order = sorted(BACKBONES, key=lambda b: b.gflops, reverse=device.startswith("cuda"))
    return [b for b in order if name in (None, b.name)]


def _cached(b: Backbone) -> Path | None:
    try:
        return hub_snapshot(b.hub, local_only=True)
    except ValueError:
        return None


def choose_backbone(device: str, name: str | None = None) -> tuple[str | None, Backbone | None, str]:
    """The backbone a planned run fine-tunes: ``(spec, backbone, how)``, ``spec`` its
    ``model.pretrained`` value ``hf-hub:REPO@COMMIT`` (the snapshot's commit: read from the cache
    with no network from then on), ``how`` saying how it was had: the first of :func:`candidates`
    already in the Hugging Face cache, else the first downloaded from the hub when it answers.
    Else ``(None, None, why)``, ``why`` saying what was tried. Never raises for the network: a
    hub that does not answer costs at most :data:`PROBE_S` seconds, once."""
    order = candidates(device, name)
    if not order:
        return None, None, f"no pretrained backbone of model.name={name} is known to vitflow"
    for b in order:
        if (folder := _cached(b)) is not None:
            return f"hf-hub:{b.hub}@{folder.name}", b, f"from the Hugging Face cache {hub_cache_dir()}"
    if not hub_reachable():
        why = "the hub is offline (HF_HUB_OFFLINE=1)" if hub_offline() else \
            f"the hub {endpoint()} could not be reached (within {PROBE_S:g} s)"
        return None, None, f"no backbone in the Hugging Face cache {hub_cache_dir()} and {why}"
    try:
        folder = hub_snapshot(order[0].hub)
    except ValueError as e:
        return None, None, str(e)
    return f"hf-hub:{order[0].hub}@{folder.name}", order[0], f"downloaded from {endpoint()} into {hub_cache_dir()}"
