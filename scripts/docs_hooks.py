"""MkDocs hooks for the docs site (mkdocs.yml's ``hooks``): what the site takes from the code.

- **Generated sections.** A page marks a place with ``<!-- generated: NAME -->`` and the build
  fills it from the code, so the text cannot go stale: ``commands`` (each ``commd`` subcommand's
  ``--help``, from ``commd.cli.main.build_parser``), ``settings`` (the daemon's options, from
  ``commd.daemon.settings.OPTIONS``) and ``error-codes`` (``commd_protocol.errors.ErrorCode``
  with the comment of each member).
- **Links out of docs/.** The pages link files of the repository (``../bench/results/*.json``,
  ``../examples/train.py``, ``../CONTRIBUTING.md``) so that they work where the Markdown is read
  on its own (GitHub, an editor). In the site, such a file is copied under ``repo/`` and the
  link points at the copy; CONTRIBUTING.md and CHANGELOG.md become pages of the site; a
  folder links its page in ``REPO_PAGES``. A link to nothing is a warning, which fails
  ``mkdocs build --strict``.
"""

from __future__ import annotations

import argparse
import logging
import os
import posixpath
import re
import tokenize
from collections.abc import Callable, Iterator
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.commd")

# Files of the repository (outside docs/) that the site holds as pages, from the repository
# path to the page's path in the site; a folder's key ends with "/".
REPO_PAGES = {
    "CONTRIBUTING.md": "contributing.md",
    "CHANGELOG.md": "changelog.md",
    "README.md": "index.md",  # the site's front page stands for the repository's
    "protocol/commd_protocol/": "reference/protocol.md",
}
# Where copies of the other linked files of the repository go in the site.
COPIES = "repo"

_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
_FENCE = re.compile(r"^\s*(```|~~~)")
_MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)

_sources: dict[str, str] = {}  # a page's src_uri in the site -> its path in the repository


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _docs_prefix(config: MkDocsConfig) -> str:
    return Path(config.docs_dir).resolve().relative_to(_root(config)).as_posix() + "/"


def _links(markdown: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, target) of each Markdown link and image of a page, outside fenced code."""
    fenced, offset = False, 0
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            for match in _LINK.finditer(line):
                start, end = match.span(2)
                yield offset + start, offset + end, match.group(2)
        offset += len(line)


def _outside(target: str, source: str, config: MkDocsConfig) -> tuple[str, str] | None:
    """(path in the repository, anchor) of a relative link from the repository file ``source``
    to a path outside docs/; None for a link that stays inside docs/, an anchor or a URL."""
    if not target or target.startswith(("#", "/")) or re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    if resolved.startswith(_docs_prefix(config)) and source.startswith(_docs_prefix(config)):
        return None
    if path.endswith("/") or (_root(config) / resolved).is_dir():
        resolved += "/"
    return resolved, anchor


def _site_path(repo_path: str, config: MkDocsConfig) -> str | None:
    """Where the repository's file ``repo_path`` is in the site, or None if it is nowhere."""
    docs = _docs_prefix(config)
    if repo_path in REPO_PAGES:
        return REPO_PAGES[repo_path]
    if repo_path.startswith(docs):
        return repo_path[len(docs):]
    if (_root(config) / repo_path).is_file():
        return f"{COPIES}/{repo_path}"
    return None


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the repository's Markdown pages and a copy of every file outside docs/ a page
    links."""
    root, docs = _root(config), _docs_prefix(config)
    _sources.clear()
    for file in files.documentation_pages():
        _sources[file.src_uri] = docs + file.src_uri
    for repo_path, site_path in REPO_PAGES.items():
        if repo_path.endswith(".md") and not repo_path.startswith(docs) and (
            site_path not in _sources
        ):
            files.append(File.generated(config, site_path,
                                        content=(root / repo_path).read_text(encoding="utf-8")))
            _sources[site_path] = repo_path
    copied: set[str] = set()
    for source in list(_sources.values()):
        for _, _, target in _links((root / source).read_text(encoding="utf-8")):
            outside = _outside(target, source, config)
            if outside is None:
                continue
            copy = _site_path(outside[0], config)
            if copy and copy.startswith(COPIES + "/") and outside[0] not in copied:
                copied.add(outside[0])
                files.append(File.generated(config, copy, abs_src_path=str(root / outside[0])))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Point the links out of docs/ at their place in the site; fill the generated sections."""
    source = _sources.get(page.file.src_uri, _docs_prefix(config) + page.file.src_uri)
    pieces, last = [], 0
    for start, end, target in _links(markdown):
        outside = _outside(target, source, config)
        if outside is None:
            continue
        repo_path, anchor = outside
        site_path = _site_path(repo_path, config)
        if site_path is None:
            log.warning("%s links %s, which is neither in the repository nor in REPO_PAGES "
                        "(scripts/docs_hooks.py)", source, target)
            continue
        relative = posixpath.relpath(site_path, posixpath.dirname(page.file.src_uri) or ".")
        pieces += [markdown[last:start], relative + (f"#{anchor}" if anchor else "")]
        last = end
    markdown = "".join([*pieces, markdown[last:]])
    return _MARKER.sub(lambda m: _generated(m.group(1), page), markdown)


def _generated(name: str, page: Page) -> str:
    render = _SECTIONS.get(name)
    if render is None:
        log.warning("%s asks for the generated section %r; there are: %s",
                    page.file.src_uri, name, ", ".join(_SECTIONS))
        return ""
    return render()


def _commands() -> str:
    """Each subcommand's ``--help``, as ``commd SUBCOMMAND --help`` prints it, 100 columns
    wide."""
    from commd.cli.main import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: the same text everywhere
    try:
        parser = build_parser()
        (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        out = ["## `commd`", "", "```text", parser.format_help().rstrip(), "```"]
        for name, command in subparsers.choices.items():
            _machine_free(command)
            out += ["", f"## `commd {name}`", "", "```text", command.format_help().rstrip(),
                    "```"]
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(out)


# Defaults that depend on the machine building the docs, and what to say instead.
_MACHINE_DEFAULTS = {"max_job_bytes": "half of the node's memory"}


def _machine_free(parser: argparse.ArgumentParser) -> None:
    """Say the machine-dependent defaults in words in ``parser``'s help, not as this machine's
    numbers."""
    from commd.daemon.settings import OPTIONS

    defaults = {o.name: o.default for o in OPTIONS}
    for action in parser._actions:
        if action.dest in _MACHINE_DEFAULTS and action.help:
            action.help = action.help.replace(f"default {defaults[action.dest]!r}",
                                              f"default: {_MACHINE_DEFAULTS[action.dest]}")


def _settings() -> str:
    """The daemon's options: one row per field of ``Settings``, with every way to set it."""
    from commd.daemon.settings import OPTIONS

    rows = ["| option | environment / TOML key | type | default | meaning |",
            "|---|---|---|---|---|"]
    for option in OPTIONS:
        flag = "--" + option.name.replace("_", "-")
        default = _MACHINE_DEFAULTS.get(option.name, f"`{option.default!r}`")
        kind = option.type.__name__
        if option.choices:
            kind += ": " + ", ".join(f"`{c}`" for c in option.choices)
        meaning = option.help.replace("|", "\\|")
        rows.append(f"| `{flag}` | `COMMD_{option.name.upper()}`, `{option.name}` | {kind} | "
                    f"{default} | {meaning} |")
    return "\n".join(rows)


def _error_codes() -> str:
    """``ErrorCode``'s members with their values and the comment that says when it is sent."""
    from commd_protocol import errors

    comments = _member_comments(Path(errors.__file__), "ErrorCode")
    rows = ["| code | member | when |", "|---|---|---|"]
    for member in errors.ErrorCode:
        rows.append(f"| `{member.value}` | `ErrorCode.{member.name}` | "
                    f"{comments.get(member.name, '')} |")
    return "\n".join(rows)


def _member_comments(path: Path, class_name: str) -> dict[str, str]:
    """The trailing comment of each ``NAME = ...`` line of ``class_name`` in ``path``."""
    comments: dict[str, str] = {}
    inside, name = False, ""
    with path.open("rb") as handle:
        for token in tokenize.tokenize(handle.readline):
            if token.type == tokenize.NAME and token.start[1] == 0:
                inside = token.string == "class" and token.line.startswith(f"class {class_name}")
            elif inside and token.type == tokenize.NAME and token.start[1] == 4:
                name = token.string
            elif inside and token.type == tokenize.COMMENT and name:
                comments[name] = token.string.lstrip("# ").strip()
            elif token.type == tokenize.NEWLINE:
                name = ""
    return comments


_SECTIONS: dict[str, Callable[[], str]] = {
    "commands": _commands,
    "settings": _settings,
    "error-codes": _error_codes,
}


def generated_pages() -> dict[str, str]:
    """The pages the build adds (their path in the site -> their file in the repository):
    for tests/unit/test_docs_nav.py, which holds the nav to docs/ and these."""
    return {site: repo for repo, site in REPO_PAGES.items()
            if repo.endswith(".md") and not repo.startswith("docs/") and site != "index.md"}


__all__ = ["generated_pages", "on_files", "on_page_markdown"]
