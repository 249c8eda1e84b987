"""What every study does with its results: check the names it is asked to run, record the command that made them,
write the JSON, draw the PNG."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def check_names(option: str, names: Sequence[str], known: Sequence[str], source: str) -> None:
    """Refuse the ``names`` given to ``option`` that ``source`` does not define, before any run: a misspelt name would
    otherwise run nothing and keep the old results, silently."""
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"{option}: {', '.join(unknown)} not among the methods of {source}: {', '.join(known)}")


def chosen(runs: list[dict[str, Any]], names: Sequence[str] | None) -> list[dict[str, Any]]:
    """A study's ``runs`` named in ``--methods`` (``names``; all of them when None), in the study's order; a name that
    is none of theirs is refused (:func:`check_names`)."""
    check_names("--methods", names or [], [run["name"] for run in runs], "this study")
    return list(runs) if not names else [run for run in runs if run["name"] in names]


def command_line(argv: list[str] | None = None) -> str:
    """How this driver was started, as one would type it again: ``python -m benchmarks.<study>.<driver> ARGS``
    (``argv``, default the process's arguments)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [str(Path(sys.argv[0]))]
    return " ".join(["python", *program, *(sys.argv[1:] if argv is None else argv)])


def write_json(path: Path, report: Any) -> None:
    """``report`` as indented JSON at ``path`` (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def publish(json_path: Path, report: dict[str, Any], summarize: Callable[[dict[str, Any]], Any],
            table: Callable[[Any], str], draw: Callable[[dict[str, Any]], Sequence[Path]]) -> int:
    """A benchmark's last step: its summary derived from the measurements in ``report``, the whole written to
    ``json_path``, its table printed and its figures drawn (``draw`` returns their paths); returns the exit status 0."""
    report["summary"] = summarize(report)
    write_json(json_path, report)
    print(table(report["summary"]))
    print("wrote", *draw(report))
    return 0


def one_figure(plot: Callable[[dict[str, Any], Path], Any], out: Path, prefix: str
               ) -> Callable[[dict[str, Any]], list[Path]]:
    """``draw`` for :func:`publish` and :func:`replot` where a benchmark draws one figure, ``<out>/<prefix>.png``."""
    def draw(report: dict[str, Any]) -> list[Path]:
        figure = out / f"{prefix}.png"
        plot(report, figure)
        return [figure]
    return draw


def replot(json_path: Path, summarize: Callable[[dict[str, Any]], Any], table: Callable[[Any], str],
           draw: Callable[[dict[str, Any]], Sequence[Path]]) -> int:
    """A benchmark's ``--replot``: :func:`publish` again from the measurements in ``json_path``."""
    return publish(json_path, json.loads(json_path.read_text()), summarize, table, draw)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: figures go to files, no display is needed (imported on first use, so
    that running a study without plotting does not pay for matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, path: Path, dpi: int = 120) -> None:
    """Lay ``figure`` out, write it to ``path`` and free it."""
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)
