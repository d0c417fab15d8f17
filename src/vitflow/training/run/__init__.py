"""A run's life on disk and in the process: :mod:`.folder` (the run directory, its claim), :mod:`.resume`
(what a run continues from), :mod:`.preempt` (a scheduler's warning turned into a checkpoint),
:mod:`.guards` (the non-finite step guard, SIGTERM / SIGINT) and :mod:`.store_stop` (a remote store
lost mid-run)."""
