"""The README and docs/ hold together: every relative link resolves, the README stays short."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) or ![alt](target), with an optional "title"; the text may hold brackets
# one level deep. Reference-style links are not used in this repository.
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^()\s<>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@dataclass(frozen=True)
class Link:
    file: Path
    line: int
    target: str


def markdown_files() -> list[Path]:
    """README.md and every Markdown file under docs/, in a stable order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, INLINE_CODE.sub("code", line)))
    return lines


def links(path: Path) -> list[Link]:
    """Every inline Markdown link in ``path``, code blocks and code spans excluded."""
    return [
        Link(path, number, match.group(2))
        for number, line in _prose_lines(path.read_text(encoding="utf-8"))
        for match in LINK.finditer(line)
    ]


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = LINK.sub(lambda m: m.group(1), heading)  # a link in a heading counts by its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Heading anchors of a Markdown file; repeats get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    text = path.read_text(encoding="utf-8")
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def resolve(link: Link, root: Path = ROOT) -> Path:
    """The file or folder a relative link points at (``/x`` is relative to ``root``)."""
    path = unquote(link.target.partition("#")[0])
    if not path:
        return link.file
    if path.startswith("/"):
        return root / path.lstrip("/")
    return link.file.parent / path


def is_external(target: str) -> bool:
    return bool(SCHEME.match(target)) or target.startswith("//")


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One line per relative link in ``path`` whose target or ``#anchor`` does not exist."""
    problems = []
    for link in links(path):
        if is_external(link.target):
            continue
        where = f"{link.file.name}:{link.line}: ({link.target})"
        if not link.target:
            problems.append(f"{where} empty link target")
            continue
        target = resolve(link, root)
        if not target.exists():
            problems.append(f"{where} no such file or folder {target}")
            continue
        anchor = unquote(link.target.partition("#")[2])
        if anchor and target.is_file() and target.suffix == ".md" and anchor not in anchors(target):
            problems.append(f"{where} no heading with anchor #{anchor} in {target.name}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "\n".join(problems)


def test_the_checker_reports_planted_broken_links(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: here\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [folder](sub) [heading](other.md#a-code-heading-here) [self](#page)\n"
        "[web](https://example.com/missing.md) [mail](mailto:someone@example.com)\n"
        "[`code` text](other.md#other-page) ![image](sub)\n"
        "[missing file](missing.md)\n"
        "[missing anchor](other.md#no-such-heading)\n"
        "[missing self anchor](#nowhere)\n"
        "`[in a code span](also-missing.md)`\n"
        "```\n[in a code block](also-missing.md)\n```\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 3, problems
    assert "page.md:6: (missing.md) no such file" in problems[0]
    assert "page.md:7: (other.md#no-such-heading) no heading" in problems[1]
    assert "page.md:8: (#nowhere) no heading" in problems[2]


def test_github_slugs_match_the_headings_we_link() -> None:
    assert github_slug("Scaling out (DDP)") == "scaling-out-ddp"
    assert github_slug("Trade-off: `deterministic: true` vs `false`") == (
        "trade-off-deterministic-true-vs-false"
    )
    assert github_slug("Parameters (`params.yaml`)") == "parameters-paramsyaml"


def test_readme_is_short_and_links_every_top_level_doc() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    linked = {resolve(link).resolve() for link in links(README) if not is_external(link.target)}
    docs = sorted(DOCS.glob("*.md"))
    assert docs, "docs/*.md missing"
    unlinked = [doc.name for doc in docs if doc.resolve() not in linked]
    assert not unlinked, f"README.md does not link docs/{unlinked}"


def package_map(text: str) -> list[str]:
    """The module paths the package block of docs/architecture.md names, in order.

    The block starts at ``src/reprotrain/``; each level indents two spaces; a
    line is ``name.py`` or ``folder/`` and then its description.
    """
    block = text.split("\n```\nsrc/reprotrain/\n", 1)[1].split("\n```", 1)[0]
    folders: list[str] = []
    named = []
    for line in block.splitlines():
        match = re.match(r"( *)(\S+)", line)
        if not match or match[2].startswith("#"):
            continue
        depth = len(match[1]) // 2 - 1
        del folders[depth:]
        if match[2].endswith("/"):
            folders.append(match[2])
        elif match[2].endswith(".py"):
            named.append("".join(folders) + match[2])
    return named


def package_modules(package: Path) -> list[str]:
    """Every module of the package, less the subpackages' ``__init__.py`` (the folder line)."""
    return sorted(
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if "__pycache__" not in path.parts
        and (path.name != "__init__.py" or path.parent == package)
    )


def test_architecture_names_every_module_once() -> None:
    named = package_map((ROOT / "docs" / "architecture.md").read_text())
    assert sorted(set(named)) == sorted(named), "named twice"
    assert sorted(named) == package_modules(ROOT / "src" / "reprotrain")


def test_a_module_missing_from_the_architecture_map_is_caught(tmp_path: Path) -> None:
    """Negative control: an added module and a moved one both show."""
    named = package_map((ROOT / "docs" / "architecture.md").read_text())
    package = tmp_path / "reprotrain"
    for name in named:
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text("")
    assert package_modules(package) == sorted(named)
    (package / "trace" / "added.py").write_text("")
    (package / "hashing.py").rename(package / "compare" / "hashing.py")
    assert set(package_modules(package)) ^ set(named) == {
        "trace/added.py",
        "hashing.py",
        "compare/hashing.py",
    }
