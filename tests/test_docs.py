"""The documentation site builds with warnings as errors (issue 29).

``mkdocs build --strict`` fails on a broken link or anchor between pages, a benchmark plot that does not exist, a
``:::`` block naming a class or module that was renamed or removed, a docstring griffe cannot read (a parameter
documented but not in the signature) and a missing ``--8<--`` snippet (the YAML examples are the real
``configs/*.yaml``). The ``docs`` extra is installed by ``make``'s set-up, so this runs in ``make test``; in an
environment without it the test fails and says how to install it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path: Path) -> None:
    assert importlib.util.find_spec("mkdocs") is not None, (
        "mkdocs is not installed: pip install -c constraints.txt -e '.[docs]' (make's set-up does)")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # cwd: mkdocs.yml names the griffe extension, the snippets' base and the package by paths from the root.
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"mkdocs build --strict failed ({run.returncode}):\n{output}"
    # The API reference was rendered from the docstrings, and the plots were copied from benchmarks/results.
    assert "divergence_threshold" in (site / "api" / "strategies" / "index.html").read_text(encoding="utf-8")
    assert (site / "assets" / "results" / "lm_network.png").is_file()
    assert not list(site.rglob("*.py")), "the hooks and the griffe extension are not pages"
