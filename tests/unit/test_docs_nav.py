"""The docs site's nav (mkdocs.yml) against docs/: every page is in the nav once, and every page
the nav names exists, in docs/ or as a page scripts/docs_hooks.py makes from the repository.

`mkdocs build --strict` (`make docs`, in `make test`) checks the links and the build itself;
this test says which page is missing from the nav or from docs/ without building anything."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts/docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_pages(entries: Any) -> list[str]:
    """Every page path of a nav (a list of pages, titled pages and titled sections)."""
    pages: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                pages += _nav_pages(value) if isinstance(value, list) else [value]
    return [page for page in pages if not re.match(r"^[a-z]+://", page)]


def _config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    return config


def test_every_docs_page_is_in_the_nav_once() -> None:
    nav = _nav_pages(_config()["nav"])
    on_disk = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    orphans = sorted(on_disk - set(nav))
    assert not orphans, f"docs pages missing from mkdocs.yml's nav: {', '.join(orphans)}"
    twice = sorted({page for page in nav if nav.count(page) > 1})
    assert not twice, f"pages in mkdocs.yml's nav more than once: {', '.join(twice)}"


def test_every_nav_page_exists() -> None:
    generated = _hooks().generated_pages()
    for repo_file in generated.values():
        assert (ROOT / repo_file).is_file(), f"scripts/docs_hooks.py makes a page of {repo_file}"
    missing = [page for page in _nav_pages(_config()["nav"])
               if not (DOCS / page).is_file() and page not in generated]
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {', '.join(missing)}"


def test_generated_sections_are_known() -> None:
    known = set(_hooks()._SECTIONS)
    for page in DOCS.rglob("*.md"):
        for name in re.findall(r"^<!-- generated: ([a-z-]+) -->$", page.read_text("utf-8"),
                               re.MULTILINE):
            assert name in known, f"{page.relative_to(ROOT)} asks for an unknown section {name}"
