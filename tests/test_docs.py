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


README_MAX_WORDS = 1000
SUMMARY_MAX_LINES = 5
#: Pages that need not lead with a summary (none).
SUMMARY_EXEMPT: set[str] = set()
BENCH = DOCS / "cpu" / "bench.json"
#: A commit hash (7 to 40 hex digits, with a letter and a digit) or a host speed in
#: microseconds: run logs that belong in docs/lab.md, not in the README.
RUN_LOG = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b|\d\s?(us|µs)\b")


def word_count(text: str) -> int:
    """Words as ``wc -w`` counts them: runs of non-blank characters."""
    return len(text.split())


def summary_problem(text: str) -> str | None:
    """Why a page does not lead with a summary of at most SUMMARY_MAX_LINES lines, or None.

    The summary is the first block after the ``# title``: prose (not a heading, a list, a
    table, a code block or a quote), ended by a blank line.
    """
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return "no '# title' on the first line"
    rest = lines[1:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    block = []
    for line in rest:
        if not line.strip():
            break
        block.append(line)
    if not block:
        return "nothing after the title"
    if re.match(r"\s*(#|```|~~~|\||[-*+] |\d+\. |>)", block[0]):
        return f"the title is followed by {block[0][:30]!r}, not a summary"
    if len(block) > SUMMARY_MAX_LINES:
        return f"summary has {len(block)} lines (at most {SUMMARY_MAX_LINES})"
    return None


def test_readme_is_at_most_a_thousand_words() -> None:
    words = word_count(README.read_text(encoding="utf-8"))
    assert words <= README_MAX_WORDS, f"README.md has {words} words"


def test_every_doc_page_leads_with_a_short_summary() -> None:
    problems = [
        f"{page.name}: {problem}"
        for page in sorted(DOCS.glob("*.md"))
        if page.name not in SUMMARY_EXEMPT
        if (problem := summary_problem(page.read_text(encoding="utf-8")))
    ]
    assert not problems, "\n".join(problems)


def test_the_summary_check_fails_a_long_or_missing_summary() -> None:
    """Negative control: six lines, a heading or a code block first, no title."""
    assert summary_problem("# T\n\nOne.\nTwo.\n\n## More\n") is None
    assert "6 lines" in summary_problem("# T\n\n" + "line\n" * 6 + "\nrest\n")
    assert "not a summary" in summary_problem("# T\n\n## Straight to a heading\n")
    assert "not a summary" in summary_problem("# T\n\n```bash\nmake\n```\n")
    assert "no '# title'" in summary_problem("Text first\n")


def test_readme_holds_no_commit_hash_or_host_speed() -> None:
    found = [match.group(0) for match in RUN_LOG.finditer(README.read_text(encoding="utf-8"))]
    assert not found, f"README.md holds run-log figures (move them to docs/lab.md): {found}"


def test_the_run_log_check_finds_hashes_and_host_speeds() -> None:
    """Negative control: a short hash and a page speed are found; plain words and numbers not."""
    planted = "at ed32d5a 2495 s; 5.2 us a page; sha256 of weights; 84.8 ms; deadbeef"
    assert [m.group(0) for m in RUN_LOG.finditer(planted)] == ["ed32d5a", "2 us"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms"


def _pct(value: float) -> str:
    return f"{value:+.1f}".replace("+-", "-")


def bench_rows(bench: dict) -> dict[str, list[str]]:
    """The README's CPU cost rows as docs/cpu/bench.json gives them: label -> cells."""
    rows = {}
    for name, workload in bench["workloads"].items():
        size, cost = workload["size"], workload["determinism_cost"]
        if name == "pipeline":
            label = f"batch {size['data']['batch_size']}"
        else:
            label = (
                f"{size['batch_size']} x {size['channels']} x {size['image_size']} x "
                f"{size['image_size']}, width {size['width']}"
            )
        low, high = cost["ci95"]
        rows[label] = [
            _ms(workload["modes"]["deterministic"]["median_step_s"]),
            _ms(workload["modes"]["default"]["median_step_s"]),
            f"{_pct(cost['pct'])}% ({_pct(low)} .. {_pct(high)})",
        ]
    return rows


def readme_cpu_rows(text: str) -> list[list[str]]:
    """The data rows of the README's CPU cost table (the first table after its CPU line)."""
    section = text.split("## The cost of determinism", 1)[1].split("\nGPU", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]


def test_readme_cpu_cost_figures_are_docs_cpu_bench_json() -> None:
    import json

    bench = json.loads(BENCH.read_text())
    text = README.read_text(encoding="utf-8")
    assert f"--repeats {bench['repeats']}" in text
    assert bench["threads"] == 1 and "CPU, one thread" in text
    expected = bench_rows(bench)
    rows = readme_cpu_rows(text)
    assert len(rows) == len(expected), rows
    for label, *cells in rows:
        matching = [key for key in expected if label.endswith(key)]
        assert matching, f"README row {label!r} names no workload of {BENCH.name}"
        assert cells == expected[matching[0]], f"{label}: {cells} != {BENCH.name}'s"


def test_a_figure_that_drifts_from_bench_json_is_caught() -> None:
    """Negative control: one digit changed in the JSON no longer matches the README's row."""
    import json

    bench = json.loads(BENCH.read_text())
    bench["workloads"]["pipeline"]["modes"]["deterministic"]["median_step_s"] += 0.001
    drifted = bench_rows(bench)["batch 64"]
    rows = {row[0]: row[1:] for row in readme_cpu_rows(README.read_text(encoding="utf-8"))}
    (label,) = [key for key in rows if key.endswith("batch 64")]
    assert rows[label][1:] == drifted[1:] and rows[label][0] != drifted[0]


README_TEST = re.compile(r"`tests/(test_\w+\.py::test_\w+)`")


def test_every_test_the_readme_names_exists() -> None:
    from tests.test_guarantees import missing

    named = README_TEST.findall(README.read_text(encoding="utf-8"))
    assert len(named) >= 8, named
    problems = [problem for cell in named if (problem := missing(cell))]
    assert not problems, problems
    assert missing("test_train.py::test_that_was_renamed") == (
        "test_train.py::test_that_was_renamed: no such test"
    )
