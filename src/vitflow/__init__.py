"""vitflow: train, evaluate, inspect and deploy Vision Transformer image classifiers.

The Python face mirrors the command line (:mod:`vitflow.api`)::

    run = vitflow.train(data="photos/", model="vit_tiny_patch16_224", train__total_steps=300)
    clf = vitflow.load(run)                 # or a checkpoint, an .onnx / INT8 file, a hub folder
    clf.predict(images, topk=3)

``vitflow.train`` is the function :func:`vitflow.api.run.train`; the training layer is the package
:mod:`vitflow.training` (``Trainer``, ``Callback``, ...). The API's names load on first use, so
``import vitflow`` costs what the model registry costs. Modules that moved in a restructuring fail
to import with one line naming their new place (:mod:`vitflow.moved`).
"""

from typing import TYPE_CHECKING

from vitflow.models import VisionTransformer, create_model, list_models
from vitflow.moved import install as _install_moved

__version__ = "0.1.0"
_API = ("Callback", "Classifier", "Config", "Run", "inspect", "load", "train")
__all__ = ["VisionTransformer", "create_model", "list_models", "Callback", "Classifier", "Config", "Run", "inspect", "load",
           "train", "__version__"]

if TYPE_CHECKING:  # what the lazy names below are, for type checkers and editors
    from vitflow.api import Callback, Classifier, Config, Run, inspect, load, train

_install_moved()


def __getattr__(name: str):
    if name in _API:
        from vitflow import api

        value = getattr(api, name)
        globals()[name] = value  # resolved once: later lookups are plain attributes
        return value
    raise AttributeError(f"module 'vitflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
