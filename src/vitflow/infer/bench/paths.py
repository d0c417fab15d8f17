"""The paths ``vitflow bench infer`` times, one table row each (:data:`PATHS`): the peers (timm's
model of the same configuration and weights, eager, exported to ONNX Runtime and to OpenVINO) and
vitflow's deployment paths. Every path is a ``torch.nn.Module`` mapping ``float32 (B, 3, S, S)``
normalised images to logits ``float32 (B, num_classes)``, so each one's top-1 is measured the
same way as its speed.

The peers are built the way their own tools document: timm's model exported as it is
(``torch.onnx.export``, dynamo), ONNX Runtime's CPU fusions and quantizers, OpenVINO's
``convert_model`` and NNCF's ``quantize`` with OpenVINO's default CPU configuration (no precision
hint: bf16 float layers on CPUs with AMX / AVX512-BF16; the latency hint). vitflow's paths start from its
:func:`~vitflow.infer.export.deployable.deployable` export; its tuned OpenVINO path runs the same kind of
INT8 IR with the settings vitflow chooses for the machine
(:func:`~vitflow.infer.runtimes.openvino.tuned_settings`).
Calibration images (static INT8, NNCF) are the same real images for both.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from vitflow.infer.export.formats import export_onnx
from vitflow.infer.export.hub_folder import timm_model_args
from vitflow.infer.quantize.dynamic import CastModel, quantize_onnx
from vitflow.infer.quantize.static import quantize_onnx_static
from vitflow.infer.runtimes.onnx import ModelInfo, OnnxModel
from vitflow.infer.runtimes.onnx_fusion import fusion_sizes, optimize_onnx
from vitflow.infer.runtimes.openvino import OpenVinoModel, convert_onnx, nncf_quantize, tuned_settings
from vitflow.models import family_of, model_kwargs
from vitflow.models.token_merging import default_merge
from vitflow.runtime import cpu_bf16_supported


def timm_model(model_args: dict) -> torch.nn.Module:
    """timm's model of the same configuration as a vitflow ``model_args`` (eval mode, timm's
    initialisation): for the families registered under timm's names (DeiT III, DINOv2, CLIP,
    SigLIP, BEiT, EVA-02, DINOv3, Swin) ``timm.create_model(name, pretrained=False, img_size=...,
    num_classes=..., <sizes that differ>)`` (:func:`vitflow.infer.export.hub_folder.timm_model_args`); for
    the ViT family timm's ``VisionTransformer`` from the basic arguments (pruning ignored: the
    unpruned configuration); for MViTv2 timm's ``MultiScaleVit`` of the same configuration.

    Raises:
        ValueError: timm is not installed or has no model of that name; an option timm's model
            lacks (named).
    """
    try:
        import timm
        from timm.models.vision_transformer import VisionTransformer as TimmViT
    except ImportError:
        raise ValueError("vitflow bench infer compares against timm: pip install timm") from None

    if family_of(model_args["name"]).name == "mvit":
        return _timm_mvit(model_args)
    if family_of(model_args["name"]).name != "vit":
        name, targs = timm_model_args(model_args)
        if not timm.is_model(name):
            raise ValueError(f"timm {timm.__version__} has no model {name!r} to compare with: upgrade timm")
        return timm.create_model(name, pretrained=False, **targs).eval()
    args = {k: v for k, v in model_args.items() if k not in ("block_heads", "block_mlp_hidden", "lora")}
    kw = model_kwargs(args.pop("name"), **args)
    avg = kw.get("global_pool", "token") == "avg"
    return TimmViT(img_size=kw["img_size"], patch_size=kw["patch_size"], num_classes=kw.get("num_classes", 1000),
                   embed_dim=kw["embed_dim"], depth=kw["depth"], num_heads=kw["num_heads"],
                   mlp_ratio=kw.get("mlp_ratio", 4.0), global_pool="avg" if avg else "token",
                   class_token=not avg).eval()



def _timm_mvit(model_args: dict) -> torch.nn.Module:
    """timm's ``MultiScaleVit`` of an MViTv2 ``model_args``, built from its configuration
    (:func:`vitflow.models.mvit.variants.timm_config`): for a variant timm names (``mvitv2_tiny``)
    the model ``timm.create_model`` builds, for vitflow's own (``mvitv2_cifar_32``) the same class."""
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    from vitflow.models.mvit.variants import timm_config

    args = {k: v for k, v in model_args.items() if k != "lora"}
    cfg, kw = timm_config(model_kwargs(args.pop("name"), **args))
    return MultiScaleVit(MultiScaleVitCfg(**cfg), **kw).eval()

class Sources:
    """What the path builders share, each made once on first use: the float vitflow model,
    timm's model with the same weights, their ONNX exports (with ONNX Runtime's CPU fusions),
    INT8 versions, OpenVINO models, the calibration images.

    Args:
        model: the vitflow model, float32, eval mode. info: its :class:`ModelInfo`.
        workdir: where the ONNX files go.
        calibration: returns ``float32 (N, 3, S, S)`` real images (called once, when a static
            INT8 path is built).
        peer: ``(model, info)`` whose configuration and weights timm's model takes (default
            ``model``): e.g. the unpruned model a pruned one came from.
    """

    def __init__(self, model: torch.nn.Module, info: ModelInfo, workdir: str | Path,
                 calibration: Callable[[], torch.Tensor], peer: tuple[torch.nn.Module, ModelInfo] | None = None,
                 token_merge: int | list[int] | None = None):
        self.model, self.info, self.workdir = model, info, Path(workdir)
        self.peer_model, self.peer_info = peer or (model, info)
        self._calibration, self._cache = calibration, {}
        self.token_merge = token_merge

    def once(self, key: str, make: Callable[[], object]):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def calibration(self) -> torch.Tensor:
        return self.once("calibration", self._calibration)

    def timm(self) -> torch.nn.Module:
        """timm's model with the vitflow model's weights (same layout), else timm's own
        initialisation for a ViT whose layout timm lacks (pruned: speed only).

        Raises:
            ValueError: a pretrained family whose weights timm's model does not take."""
        def make():
            model, name = self.peer_model, self.peer_info.model_args["name"]
            timm = timm_model(self.peer_info.model_args)
            # vitflow keeps fixed (sin-cos) position embeddings as non-persistent buffers, timm as parameters
            state = {**dict(model.named_buffers()), **model.state_dict()}
            want = {k: v.shape for k, v in timm.state_dict().items()}
            if all(k in state and state[k].shape == v for k, v in want.items()) and set(model.state_dict()) <= set(want):
                timm.load_state_dict({k: state[k] for k in want})  # same layout: same numbers, fair timing
            elif family_of(name).name != "vit":
                raise ValueError(f"timm's {name} does not take the checkpoint's weights (other names or shapes): "
                                 "no fair comparison")
            return timm
        return self.once("timm", make)

    def merged(self) -> torch.nn.Module:
        """A copy of the vitflow model with token merging (``token_merge``; default
        :func:`~vitflow.models.token_merging.default_merge` of its geometry).

        Raises:
            ValueError: a model that cannot merge (:func:`~vitflow.models.token_merging.check_mergeable`)."""
        def make():
            model = copy.deepcopy(self.model)
            if not hasattr(model, "set_token_merge"):
                raise ValueError(f"token merging is for the ViT family; {self.info.model_args['name']} has none")
            r = self.token_merge or default_merge(model.grid_size**2, len(model.blocks))
            model.set_token_merge(r)
            return model.eval()
        return self.once("merged", make)

    def yardstick(self) -> str:
        """Whose export the ``ov_best_*`` paths run: ``reference`` (the peer's model through
        vitflow's export, e.g. the unpruned model of a pruned checkpoint) when a peer was given,
        else ``vitflow``."""
        return "vitflow" if self.peer_model is self.model else "reference"

    def onnx(self, who: str) -> Path:
        """The fp32 ONNX file of ``who`` (``vitflow``: its deployable export; ``tome``: the same
        with token merging; ``reference``: the peer's model through the same export; ``timm``:
        timm's model as it is) with ONNX Runtime's CPU fusions."""
        def make():
            raw, opt = self.workdir / f"{who}.onnx", self.workdir / f"{who}.opt.onnx"
            model = {"vitflow": lambda: self.model, "tome": self.merged, "timm": self.timm,
                     "reference": lambda: self.peer_model}[who]()
            export_onnx(model, raw, self.peer_info if who in ("timm", "reference") else self.info, as_is=who == "timm")
            optimize_onnx(raw, opt, "cpu", *fusion_sizes(model))
            return raw, opt
        return self.once(f"onnx-{who}", make)[1]

    def raw_onnx(self, who: str) -> Path:
        """The ONNX export of ``who`` without ONNX Runtime's fusions (what OpenVINO converts)."""
        self.onnx(who)
        return self.workdir / f"{who}.onnx"

    def onnx_int8(self, who: str, static: bool) -> Path:
        """Dynamic or (``static``) calibrated INT8 (minmax ranges) of :meth:`onnx`."""
        def make():
            dst = self.workdir / f"{who}.{'static' if static else 'dynamic'}.onnx"
            if static:
                quantize_onnx_static(self.onnx(who), dst, self.calibration())
            else:
                quantize_onnx(self.onnx(who), dst)
            return dst
        return self.once(f"int8-{who}-{static}", make)

    def openvino(self, who: str, int8: bool = False):
        """The ``openvino.Model`` of ``who``'s export; ``int8``: quantised by NNCF."""
        if int8:
            return self.once(f"ov-int8-{who}", lambda: nncf_quantize(self.openvino(who), self.calibration()))
        return self.once(f"ov-{who}", lambda: convert_onnx(self.raw_onnx(who)))


def _bf16(model: torch.nn.Module) -> torch.nn.Module:
    return CastModel(copy.deepcopy(model).to(torch.bfloat16).eval(), torch.bfloat16)


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` (inductor) of the bf16 model where the CPU has native bf16, else fp32."""
    if cpu_bf16_supported():
        return CastModel(torch.compile(copy.deepcopy(model).to(torch.bfloat16), dynamic=False), torch.bfloat16)
    return torch.compile(copy.deepcopy(model), dynamic=False)


@dataclass(frozen=True)
class PathSpec:
    """One benchmark path: ``peer`` (timm's model through its tools) or ``vitflow``, a
    description, the builder of its module from the shared :class:`Sources`, and the optional
    packages it needs (its module names)."""

    group: str
    what: str
    build: Callable[[Sources], torch.nn.Module]
    needs: tuple[str, ...] = ()

    def missing(self) -> list[str]:
        """The packages of :attr:`needs` that are not installed."""
        return [m for m in self.needs if importlib.util.find_spec(m) is None]


def _ov(who: str, int8: bool, **settings) -> Callable[[Sources], torch.nn.Module]:
    return lambda s: OpenVinoModel(s.openvino(who, int8), name=f"{who} openvino", **settings)


def _ov_best(hint: str) -> Callable[[Sources], torch.nn.Module]:
    """OpenVINO's documented best (:data:`OV_BEST`, ``hint``) on the yardstick's export
    (:meth:`Sources.yardstick`)."""
    return lambda s: _ov(s.yardstick(), True, hint=hint, **OV_BEST)(s)


TIMM, ORT, OV = ("timm",), ("onnxruntime",), ("openvino", "nncf")  # what the paths need installed
# OpenVINO's documented best for the CPU: bf16 float layers where native, a static shape per batch size (its
# model.reshape; the hint is each path's own)
OV_BEST = {"precision": "bf16" if cpu_bf16_supported() else "auto", "static_shapes": True}
PATHS: dict[str, PathSpec] = {
    "timm_eager_fp32": PathSpec("peer", "timm, fp32 eager (the baseline of the ratios)", lambda s: s.timm(), TIMM),
    "timm_eager_bf16": PathSpec("peer", "timm, bf16 weights", lambda s: _bf16(s.timm()), TIMM),
    "timm_onnxruntime_fp32": PathSpec("peer", "timm's ONNX export, CPU fusions, ONNX Runtime",
                                      lambda s: OnnxModel(s.onnx("timm")), TIMM + ORT),
    "timm_onnxruntime_int8": PathSpec("peer", "the same, dynamic INT8", lambda s: OnnxModel(s.onnx_int8("timm", False)),
                                      TIMM + ORT),
    "timm_onnxruntime_int8_static": PathSpec("peer", "the same, static INT8 (QDQ, minmax calibration)",
                                             lambda s: OnnxModel(s.onnx_int8("timm", True)), TIMM + ORT),
    "timm_openvino_fp32": PathSpec("peer", "timm's ONNX export in OpenVINO, f32", _ov("timm", False, precision="fp32"),
                                   TIMM + OV),
    "timm_openvino_bf16": PathSpec("peer", "the same, bf16 precision hint", _ov("timm", False, precision="bf16"),
                                   TIMM + OV),
    "timm_openvino_int8": PathSpec("peer", "the same, INT8 by NNCF, OpenVINO's defaults",
                                   _ov("timm", True, precision="auto"), TIMM + OV),
    "eager_fp32": PathSpec("vitflow", "vitflow, fp32 eager", lambda s: s.model),
    "eager_bf16": PathSpec("vitflow", "vitflow, bf16 weights", lambda s: _bf16(s.model)),
    "compiled": PathSpec("vitflow", "torch.compile (inductor), bf16 weights where native", lambda s: _compiled(s.model)),
    "onnxruntime_fp32": PathSpec("vitflow", "vitflow's ONNX export, CPU fusions, ONNX Runtime",
                                 lambda s: OnnxModel(s.onnx("vitflow")), ORT),
    "onnxruntime_int8": PathSpec("vitflow", "the same, dynamic INT8 (vitflow quantize)",
                                 lambda s: OnnxModel(s.onnx_int8("vitflow", False)), ORT),
    "onnxruntime_int8_static": PathSpec("vitflow", "the same, static INT8 (vitflow quantize --calibrate)",
                                        lambda s: OnnxModel(s.onnx_int8("vitflow", True)), ORT),
    "openvino_fp32": PathSpec("vitflow", "vitflow's export in OpenVINO, f32", _ov("vitflow", False, precision="fp32"),
                              OV),
    "openvino_bf16": PathSpec("vitflow", "the same, bf16", _ov("vitflow", False, precision="bf16"), OV),
    "openvino_int8": PathSpec("vitflow", "the same, INT8 by NNCF, OpenVINO's defaults",
                              _ov("vitflow", True, precision="auto"), OV),
    "openvino_int8_tuned": PathSpec("vitflow", "the same INT8 IR, vitflow's settings for this CPU",
                                    lambda s: OpenVinoModel(s.openvino("vitflow", True), name="vitflow openvino",
                                                            **tuned_settings()), OV),
    "tome_eager_fp32": PathSpec("vitflow", "token merging (ToMe), fp32 eager", lambda s: s.merged()),
    "tome_onnxruntime_fp32": PathSpec("vitflow", "token merging, its ONNX export, ONNX Runtime",
                                      lambda s: OnnxModel(s.onnx("tome")), ORT),
    "tome_openvino_int8_tuned": PathSpec("vitflow", "token merging, INT8 by NNCF, vitflow's OpenVINO settings",
                                         lambda s: OpenVinoModel(s.openvino("tome", True), name="tome openvino",
                                                                 **tuned_settings()), OV),
    # OpenVINO used well on vitflow's own export (of the --reference model when there is one, e.g. the unpruned
    # model): what any OpenVINO user of that export gets (the yardstick)
    "ov_best_throughput": PathSpec("openvino", "vitflow's export (the reference's with --reference), INT8 by NNCF, "
                                   "bf16 where native, static shapes, throughput hint", _ov_best("throughput"), OV),
    "ov_best_latency": PathSpec("openvino", "the same, latency hint", _ov_best("latency"), OV),
}
