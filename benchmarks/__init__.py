"""The package's benchmarks: one folder per study (its driver, its torchrun worker, its README), the shared parts in
``common``. Run a study from the repository root as a module, e.g. ``python -m benchmarks.averaging.run``; every
study writes its JSON and PNG to ``benchmarks/results``."""
