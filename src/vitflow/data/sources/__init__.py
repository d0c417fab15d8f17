"""Image sources: the images and labels of one split, whatever they are stored in.

:mod:`.base` holds the interface (:class:`~vitflow.data.sources.base.ImageSource`) and the errors;
one module per kind reads it and declares the kind's record (:class:`~vitflow.data.sources.kind.SourceKind`:
detection, split names, opening a split): folder and tar: :mod:`.folder`; label files:
:mod:`.labelfile`; Hugging Face datasets: :mod:`.hf`; CIFAR batches: :mod:`.cifar`; the embedded
digits: :mod:`.digits`; packed datasets: :mod:`.packed`; shards: :mod:`vitflow.data.wds.kind`.
:mod:`.table` lists the records in detection order (a new kind: its module and one row there);
:mod:`.dispatch` reads the table to turn a path into a split's source, :mod:`.remote` to find the
kind at a URL. Split expressions: :mod:`.splits`; named evaluation splits: :mod:`.evals`; labels
from table columns: :mod:`.labels`.
"""
