"""vitflow: train, evaluate, inspect and deploy Vision Transformer image classifiers.

The Python face mirrors the command line (:mod:`vitflow.api`)::

    run = vitflow.train(data="photos/", model="vit_tiny_patch16_224", train__total_steps=300)
    clf = vitflow.load(run)                 # or a checkpoint, an .onnx / INT8 file, a hub folder
    clf.predict(images, topk=3)

``vitflow.train`` is also the training layer's package (``vitflow.train.Trainer``, ...): the
package is callable, and calling it runs :func:`vitflow.api.train`. The API's names load on first
use, so ``import vitflow`` costs what the model registry costs.
"""

import types

from vitflow import train as _training
from vitflow.models import VisionTransformer, create_model, list_models

__version__ = "0.1.0"
_API = ("Callback", "Classifier", "Config", "Run", "load")
__all__ = ["VisionTransformer", "create_model", "list_models", "train", *_API, "__version__"]


class _TrainingPackage(types.ModuleType):
    """The ``vitflow.train`` package, callable: ``vitflow.train(data=..., model=..., preset=None,
    callbacks=(), **overrides)`` is :func:`vitflow.api.train`."""

    def __call__(self, data=None, model=None, preset=None, callbacks=(), *, config=None, val=None, test=None,
                 **overrides):
        """Train (``vitflow train`` from Python) and return the :class:`vitflow.Run`; the arguments
        are :func:`vitflow.api.train`'s (``help(vitflow.api.train)``): ``data`` a path or a Dataset /
        iterable / DataFrame, ``model`` a name, weights or a run, ``preset`` a preset or YAML file,
        config keys as ``section__key=value``."""
        from vitflow.api import train

        return train(data, model, preset, callbacks, config=config, val=val, test=test, **overrides)


_training.__class__ = _TrainingPackage


def __getattr__(name: str):
    if name in _API:
        from vitflow import api

        return getattr(api, name)
    raise AttributeError(f"module 'vitflow' has no attribute {name!r}")
