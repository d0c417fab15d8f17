"""The planned recipe (``vitflow train data.path=PHOTOS``): :mod:`.recipe` (the plan from the data,
the machine and its clock), :mod:`.rules` (one rule per planned key), :mod:`.clock` (the step-time
probe, evaluations in time) and :mod:`.budget` (the time budget and progressive resizing)."""
