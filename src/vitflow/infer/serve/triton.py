"""``vitflow export RUN --format triton -o REPO``: a Triton Inference Server model repository
(Triton's ``model_repository`` layout) that serves the checkpoint's ONNX export with Triton's
dynamic batching::

    REPO/<name>/config.pbtxt      backend "onnxruntime", max_batch_size, input pixel_values
                                  FP32 [3, S, S], output logits FP32 [C] with labels.txt,
                                  dynamic_batching { preferred_batch_size, max_queue_delay_microseconds },
                                  instance_group, and the vitflow preprocessing as parameters
    REPO/<name>/labels.txt        the class names, line i = logit i (Triton's classification extension)
    REPO/<name>/1/model.onnx      ``vitflow export``'s ONNX file (verified against the checkpoint)

The graph takes normalised pixels: a Triton client applies the preprocessing written in the
config's ``parameters`` (resize, center crop, mean and std: ``vitflow.preprocess``), as
``vitflow serve`` does itself. No Triton server runs here: the config is written from a protobuf
message holding the fields used of Triton's ``ModelConfig`` (``inference`` package, the field
names and numbers of Triton's ``model_config.proto``) and read back with protobuf's text-format
parser, which refuses a misspelt field or a value of the wrong type.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

from vitflow.infer.export.formats import export_checkpoint
from vitflow.infer.runtimes.onnx import INPUT_NAME, OUTPUT_NAME, OnnxModel

F = descriptor_pb2.FieldDescriptorProto
_FIELDS = {  # message: [(field name, number, type, repeated, message or enum type name)]
    "ModelInput": [("name", 1, F.TYPE_STRING, False, None), ("data_type", 2, F.TYPE_ENUM, False, "DataType"),
                   ("dims", 4, F.TYPE_INT64, True, None)],
    "ModelOutput": [("name", 1, F.TYPE_STRING, False, None), ("data_type", 2, F.TYPE_ENUM, False, "DataType"),
                    ("dims", 3, F.TYPE_INT64, True, None), ("label_filename", 4, F.TYPE_STRING, False, None)],
    "ModelInstanceGroup": [("name", 1, F.TYPE_STRING, False, None), ("count", 2, F.TYPE_INT32, False, None),
                           ("kind", 4, F.TYPE_ENUM, False, "ModelInstanceGroup.Kind")],
    "ModelDynamicBatching": [("preferred_batch_size", 1, F.TYPE_INT32, True, None),
                             ("max_queue_delay_microseconds", 2, F.TYPE_UINT64, False, None)],
    "ModelParameter": [("string_value", 1, F.TYPE_STRING, False, None)],
    "ModelConfig": [("name", 1, F.TYPE_STRING, False, None), ("max_batch_size", 4, F.TYPE_INT32, False, None),
                    ("input", 5, F.TYPE_MESSAGE, True, "ModelInput"), ("output", 6, F.TYPE_MESSAGE, True, "ModelOutput"),
                    ("instance_group", 7, F.TYPE_MESSAGE, True, "ModelInstanceGroup"),
                    ("dynamic_batching", 11, F.TYPE_MESSAGE, False, "ModelDynamicBatching"),
                    ("parameters", 14, F.TYPE_MESSAGE, True, "ModelConfig.ParametersEntry"),
                    ("backend", 17, F.TYPE_STRING, False, None)],
}
_ENUMS = {"DataType": ["TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64",
                       "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64", "TYPE_FP16", "TYPE_FP32", "TYPE_FP64",
                       "TYPE_STRING", "TYPE_BF16"],
          "Kind": ["KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL"]}


def _add_fields(msg: descriptor_pb2.DescriptorProto, fields) -> None:
    for name, number, ftype, repeated, type_name in fields:
        f = msg.field.add(name=name, number=number, type=ftype,
                          label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
        if type_name:
            f.type_name = f".inference.{type_name}"


@functools.cache
def model_config_class():
    """The message class of Triton's ``inference.ModelConfig`` (the fields this module writes)."""
    pool = descriptor_pool.DescriptorPool()
    fd = descriptor_pb2.FileDescriptorProto(name="vitflow_triton_model_config.proto", package="inference",
                                            syntax="proto3")
    fd.enum_type.add(name="DataType").value.extend(
        descriptor_pb2.EnumValueDescriptorProto(name=n, number=i) for i, n in enumerate(_ENUMS["DataType"]))
    for name, fields in _FIELDS.items():
        msg = fd.message_type.add(name=name)
        _add_fields(msg, fields)
        if name == "ModelInstanceGroup":
            msg.enum_type.add(name="Kind").value.extend(
                descriptor_pb2.EnumValueDescriptorProto(name=n, number=i) for i, n in enumerate(_ENUMS["Kind"]))
        if name == "ModelConfig":
            entry = msg.nested_type.add(name="ParametersEntry")
            entry.options.map_entry = True
            _add_fields(entry, [("key", 1, F.TYPE_STRING, False, None),
                                ("value", 2, F.TYPE_MESSAGE, False, "ModelParameter")])
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("inference.ModelConfig"))


def read_config(path: str | Path):
    """Parse a ``config.pbtxt`` into a ModelConfig message. Raises ValueError naming the file and
    the line of a field that is not Triton's or a value of the wrong type."""
    try:
        return text_format.Parse(Path(path).read_text(), model_config_class()())
    except text_format.ParseError as e:
        raise ValueError(f"{path}: not a valid Triton model config: {e}") from None


def _config(name: str, onnx: Path, max_batch: int, max_wait_ms: float, instances: int, kind: str):
    info = OnnxModel(onnx, threads=1).info()
    cfg = model_config_class()(name=name, backend="onnxruntime", max_batch_size=max_batch)
    size = info.preprocess.image_size
    cfg.input.add(name=INPUT_NAME, data_type=11, dims=[3, size, size])  # TYPE_FP32
    cfg.output.add(name=OUTPUT_NAME, data_type=11, dims=[len(info.classes)], label_filename="labels.txt")
    cfg.instance_group.add(count=instances, kind=_ENUMS["Kind"].index(kind))
    preferred = sorted({b for b in (max_batch // 4, max_batch // 2, max_batch) if b >= 1})
    cfg.dynamic_batching.preferred_batch_size.extend(preferred)
    cfg.dynamic_batching.max_queue_delay_microseconds = int(round(max_wait_ms * 1000))
    for key, value in (("vitflow.preprocess", json.dumps(info.preprocess.to_dict())), ("vitflow.task", info.task),
                       ("vitflow.threshold", json.dumps(info.threshold)), ("vitflow.tta", info.tta)):
        cfg.parameters[key].string_value = value
    return cfg, info.classes


def write_triton_repository(checkpoint: str | Path, out: str | Path, name: str | None = None,
                            max_batch: int = 16, max_wait_ms: float = 5.0, instances: int = 1,
                            kind: str = "KIND_CPU", **export_kwargs: Any) -> dict:
    """Write the repository (layout in the module docstring) for ``checkpoint``.

    Args:
        **export_kwargs: to :func:`vitflow.infer.export.formats.export_checkpoint`, which writes and
            verifies ``<name>/1/model.onnx`` (``optimize``, ``target``, ``verify_data``, ``log``, ...).
        name: the model's name in Triton (default: the checkpoint's run or file name, as letters,
            digits, ``_`` and ``-``).
        max_batch: ``max_batch_size``; ``max_wait_ms``: ``max_queue_delay_microseconds`` / 1000.
        instances: the ``instance_group``'s count.
        kind: the ``instance_group``'s kind, ``KIND_CPU`` or ``KIND_GPU``.
    Returns:
        the export's result with ``repository``, ``model``, ``config`` (the path) and
        ``dynamic_batching`` (as read back).
    Raises:
        ValueError: ``out`` exists and is not empty (nothing is overwritten), or what the export
            raises.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"-o {out}: exists and is not an empty folder; choose a new folder for the repository")
    src = Path(checkpoint)
    run = src if src.is_dir() else src.parent.parent if src.parent.name == "checkpoints" else None
    name = name or re.sub(r"[^A-Za-z0-9_-]+", "_", run.name if run else src.stem)
    version = out / name / "1"
    version.mkdir(parents=True)
    r = export_checkpoint(src, version / "model.onnx", "onnx", **export_kwargs)
    cfg, classes = _config(name, version / "model.onnx", max_batch, max_wait_ms, instances, kind)
    (out / name / "labels.txt").write_text("".join(f"{c}\n" for c in classes), encoding="utf-8")
    path = out / name / "config.pbtxt"
    path.write_text(text_format.MessageToString(cfg))
    back = read_config(path)
    if back != cfg:
        raise ValueError(f"{path} does not read back as written")
    return {**r, "repository": str(out), "model": name, "config": str(path),
            "dynamic_batching": {"preferred_batch_size": list(back.dynamic_batching.preferred_batch_size),
                                 "max_queue_delay_microseconds": back.dynamic_batching.max_queue_delay_microseconds}}
