"""The results tables in README.md and docs/results are the JSON's (benchmarks/common/tables.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.common import tables
from benchmarks.language_model.tables import readme_table

TARGET = "benchmarks.language_model.tables:readme_table"


def test_every_committed_table_is_what_its_json_renders() -> None:
    differing = {str(path): tables.stale(path) for path in tables.documents()}
    assert not any(differing.values()), (
        f"tables edited by hand or JSON changed since they were rendered: {differing}; run python -m "
        f"benchmarks.common.tables")


def test_the_readme_has_one_rendered_results_table() -> None:
    text = (tables.REPO / "README.md").read_text(encoding="utf-8")
    assert [match["target"] for match in tables.blocks(text)] == [TARGET]
    assert len(text.splitlines()) <= 120


def test_a_figure_changed_by_hand_is_found_and_rendered_back(tmp_path: Path) -> None:
    table = readme_table()
    edited = table.replace("|", "| 9.9", 1)
    page = tmp_path / "page.md"
    page.write_text(f"before\n<!-- table: {TARGET} -->\n{edited}\n<!-- /table -->\nafter\n", encoding="utf-8")
    assert tables.stale(page) == [TARGET]
    assert tables.rendered(page.read_text(encoding="utf-8")) == (
        f"before\n<!-- table: {TARGET} -->\n{table}\n<!-- /table -->\nafter\n")


def test_an_unclosed_block_is_refused() -> None:
    with pytest.raises(ValueError, match="no '<!-- /table -->'"):
        list(tables.blocks(f"<!-- table: {TARGET} -->\n| a |\n"))


def test_a_sentence_that_names_the_comments_is_no_block() -> None:
    text = "Tables sit between `<!-- table: module:function -->` and `<!-- /table -->`.\n"
    assert list(tables.blocks(text)) == [] and tables.rendered(text) == text
