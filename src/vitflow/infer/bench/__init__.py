"""Inference measured: :mod:`.infer` (``vitflow bench infer``: every deployment path against the
peers), :mod:`.paths` (its table of paths), :mod:`.timing` (the protocol every side-by-side speed
figure uses) and :mod:`.resolution` (``vitflow bench resolution``: accuracy, speed and memory
against the input size)."""
