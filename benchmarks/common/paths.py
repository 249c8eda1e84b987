"""Where the studies live and where their results go, whatever the working directory."""

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
EXAMPLES = REPO / "examples"


def load_example(name: str) -> ModuleType:
    """The script ``examples/<name>.py`` as a module (examples/ is no package), for the studies and tests that call
    its functions rather than run it."""
    spec = importlib.util.spec_from_file_location(name.replace("/", "_"), EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
