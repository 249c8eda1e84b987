"""A griffe extension for the API reference: the docstrings' Sphinx roles as Markdown.

The package's docstrings are Google style with reStructuredText inline markup: ``:class:`~a.b.C```,
``:func:`f```, ``:mod:`a.b```, ``:meth:`title <a.b.C.m>```, and ``::`` before a literal block. mkdocstrings renders Markdown, where
a role would show as ``:class:`` followed by code. This turns each role into an *optional*
cross-reference (``<autoref optional ...>``): a link when the target is on one of the API pages, plain
code otherwise, so a role naming a private module never breaks ``mkdocs build --strict``. A ``~`` keeps
only the last name, as in Sphinx. Relative names (``:class:`LocalUpdateStrategy```) are looked up from
the documented object outwards. Nothing in ``lightning_dist`` changes; only the rendered text does.

Loaded by mkdocstrings (``mkdocs.yml``: ``extensions: [docs/griffe_roles.py:SphinxRoles]``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(?P<tilde>~?)(?P<target>[^`]+)`")
LITERAL_BLOCK = re.compile(r"::\n\n")
EXPLICIT_TITLE = re.compile(r"(?P<title>[^<]+?)\s*<(?P<target>[^>]+)>")


def _resolve(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as written in ``obj``'s docstring, or ``target`` when unknown."""
    target = target.lstrip(".")
    if target.startswith("lightning_dist.") or target == "lightning_dist":
        return target
    first, _, rest = target.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            member = scope.members.get(first)
        except Exception:  # an alias whose target griffe could not load
            member = None
        if member is not None:
            try:
                path = member.target_path if member.is_alias else member.path
            except Exception:
                path = member.path
            return f"{path}.{rest}" if rest else path
        scope = scope.parent
    return target


def _markdown(obj: griffe.Object, text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        target = match["target"]
        explicit = EXPLICIT_TITLE.fullmatch(target)
        if explicit:  # Sphinx's ``:meth:`title <target>```
            title, target = explicit["title"], explicit["target"]
        else:
            title = target.rsplit(".", 1)[-1] if match["tilde"] else target
        identifier = _resolve(obj, target)
        return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'

    return LITERAL_BLOCK.sub(":\n\n", ROLE.sub(replace, text))


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring's Sphinx roles once the package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._walk(pkg, seen=set())

    # The same event under griffe 1's name; rewriting twice changes nothing.
    on_package_loaded = on_package

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = _markdown(obj, obj.docstring.value)
        for member in list(obj.members.values()):
            if not member.is_alias:
                self._walk(member, seen)
