"""The Python face of vitflow, mirroring the command line one concept per name:

- :func:`train` (``vitflow.train``): ``vitflow train`` from Python, on a path or on the user's own
  data (a ``torch.utils.data.Dataset``, an iterable, a pandas DataFrame), returning a :class:`Run`;
- :class:`Run`: a run folder, its figures and checkpoints, and ``evaluate`` / ``predict`` /
  ``export`` / ``quantize`` / ``report`` / ``resume`` (``vitflow eval``, ``predict``, ...);
- :func:`load` (``vitflow.load``): a trained model (a run, a checkpoint, an ONNX or INT8 file, a hub
  folder, an ``hf-hub:`` name) as a :class:`Classifier` with ``predict`` / ``embed`` /
  ``attention_maps``, with the preprocessing and the numbers of ``vitflow predict``;
- :class:`Config`: the typed configuration tree, validated as the command line validates it;
- :class:`Callback`: user code called at every step and evaluation, which can stop the run;
- :func:`inspect` (``vitflow.inspect``): ``vitflow inspect``: label issues, leaks and copies,
  outliers and broken files of a dataset, as a pandas DataFrame and a page.
"""

from vitflow.api.classifier import Classifier, load
from vitflow.api.config import Config
from vitflow.api.quality import inspect
from vitflow.api.run import Run, train
from vitflow.training.callbacks import Callback

__all__ = ["Callback", "Classifier", "Config", "Run", "inspect", "load", "train"]
