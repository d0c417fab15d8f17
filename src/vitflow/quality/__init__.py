"""What a dataset holds that a figure should not trust (``vitflow inspect``; the Python face is
:func:`vitflow.inspect`): label issues (:mod:`.labels`), exact and near copies and leaks across
splits (:mod:`.duplicates`, :mod:`.phash`), outliers and broken, tiny, elongated or blank images
(:mod:`.outliers`), from one pass over every split (:mod:`.scan`); the findings table and its
files (:mod:`.findings`), the page (:mod:`.page`) and the pass that ties them (:mod:`.inspection`).

It reads data through :mod:`vitflow.data` and a model through :mod:`vitflow.infer`; it never
trains (the API's k-fold path trains and hands it the probabilities).
"""
