"""Image sources: the images and labels of one split, whatever they are stored in.

:mod:`.base` holds the interface (:class:`~vitflow.data.sources.base.ImageSource`) and the errors;
one module per kind reads it (folder and tar: :mod:`.folder`; label files: :mod:`.labelfile`;
Hugging Face datasets: :mod:`.hf`; CIFAR batches: :mod:`.cifar`; the embedded digits:
:mod:`.digits`; packed datasets: :mod:`.packed`; URLs: :mod:`.remote`; shards: :mod:`vitflow.data.wds`);
:mod:`.dispatch` turns a path into a split's source. Split expressions: :mod:`.splits`; named
evaluation splits: :mod:`.evals`; labels from table columns: :mod:`.labels`.
"""
