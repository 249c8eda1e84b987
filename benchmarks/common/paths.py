"""Where the studies live and where their results go, whatever the working directory."""

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
