"""MkDocs hooks (``mkdocs.yml``: ``hooks: [docs/hooks.py]``): the benchmark plots the pages show.

The plots live in ``benchmarks/results/`` (next to the JSON they are drawn from, about 4 MB of PNGs), outside
``docs_dir``. Pages refer to them as ``assets/results/<path under benchmarks/results>`` (``../assets/results/...``
from a subfolder); at build time this adds each PNG a page names to the site's files, so ``mkdocs build`` copies
exactly those into ``site/assets/results/`` and checks every such image link like any other. A page naming a PNG
that does not exist gets no file, and ``--strict`` fails on the broken link. No copy is kept in ``docs/``, and
``mkdocs serve`` does not watch ``benchmarks/results/`` (rebuild to see a new plot).
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
PREFIX = "assets/results/"
REFERENCE = re.compile(re.escape(PREFIX) + r"([\w./-]+?\.png)")


def on_files(files: Files, config, **kwargs) -> Files:
    docs_dir = Path(config["docs_dir"])
    wanted: set[str] = set()
    for page in files.documentation_pages():
        wanted.update(REFERENCE.findall((docs_dir / page.src_uri).read_text(encoding="utf-8")))
    for name in sorted(wanted):
        source = (RESULTS / name).resolve()
        if RESULTS.resolve() in source.parents and source.is_file():
            files.append(File.generated(config, PREFIX + name, abs_src_path=str(source)))
    return files
