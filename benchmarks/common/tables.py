"""Results tables in Markdown rendered from the JSON in ``benchmarks/results``, so a committed table cannot drift from
the measurements it reports.

A table in ``README.md``, a page under ``docs/`` or a benchmark's README sits between two comments, the first
naming the function that renders it (a function of no arguments in a benchmark's module, returning the table's lines)::

    <!-- table: benchmarks.language_model.tables:readme_table -->
    | method | ... |
    |---|...|
    <!-- /table -->

``python -m benchmarks.common.tables`` rewrites every such block from the JSON; ``--check`` changes nothing and
lists the blocks that differ (``tests/benchmarks/test_tables.py`` runs it, so a hand-edited figure fails the suite).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.common.paths import REPO, RESULTS

BLOCK = re.compile(r"^(?P<open><!-- table: (?P<target>[\w.]+:\w+) -->\n)(?P<body>.*?)(?P<close>^<!-- /table -->)",
                   re.DOTALL | re.MULTILINE)
OPENING = re.compile(r"^<!-- table: ", re.MULTILINE)
"""A block's comments start their lines (a page may name them inside a sentence)."""


def result(name: str) -> Any:
    """The report ``benchmarks/results/<name>.json``, as its benchmark wrote it."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def documents(root: Path = REPO) -> list[Path]:
    """The Markdown files whose blocks are rendered: the README, every page of the docs, the benchmarks' READMEs."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md")), *sorted((root / "benchmarks").rglob("*.md"))]


def renderer(target: str) -> Callable[[], str]:
    """The function ``module:function`` names."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def blocks(text: str) -> Iterator[re.Match[str]]:
    """Each rendered block of ``text``; an opening comment left without its closing one is refused."""
    found = list(BLOCK.finditer(text))
    if len(OPENING.findall(text)) != len(found):
        raise ValueError("a '<!-- table: module:function -->' comment has no '<!-- /table -->' after it")
    return iter(found)


def rendered(text: str) -> str:
    """``text`` with every block's body replaced by what its function renders now."""
    return BLOCK.sub(lambda match: match["open"] + renderer(match["target"])().rstrip("\n") + "\n" + match["close"],
                     text)


def stale(path: Path) -> list[str]:
    """The targets of ``path``'s blocks whose committed body differs from what the JSON renders."""
    text = path.read_text(encoding="utf-8")
    fresh = {match["target"]: match["body"] for match in blocks(rendered(text))}
    return [match["target"] for match in blocks(text) if match["body"] != fresh[match["target"]]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 listing the stale tables")
    args = parser.parse_args(argv)
    differing = []
    for path in documents():
        if args.check:
            differing += [f"{path.relative_to(REPO)}: {target}" for target in stale(path)]
            continue
        text = path.read_text(encoding="utf-8")
        fresh = rendered(text)
        if fresh != text:
            path.write_text(fresh, encoding="utf-8")
            print("rewrote", path.relative_to(REPO))
    if differing:
        print("tables that differ from their JSON (python -m benchmarks.common.tables rewrites them):",
              *differing, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
