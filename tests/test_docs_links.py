"""The pages cannot drift from the tree: every relative link and every path they name exists.

Checked in README.md, BENCHMARKS.md, every docs/*.md and every benchmark topic page,
docs/benchmarks/*.md:
- each relative Markdown link (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`, images
  too) names a file or folder that exists, and its anchor is a heading of the target (GitHub's
  slug: lowercase, punctuation other than `-` and `_` removed, spaces to `-`);
- each repository path named in inline or fenced code (`engine/llm.py`, `tests/test_mesh.py::x`,
  `kernels/triton/`, `bench/results/moe-{bf16,fp8}-h100-2026-11-25.json`, `Makefile`) exists;
- each module named as `pdmesh.x.y` (`python -m pdmesh.bench.gpu`) resolves to a module of the
  tree through `pyproject.toml`'s package-dir mapping;
- `docs/README.md` links every page of docs/ and of docs/benchmarks/; BENCHMARKS.md, the entry
  page of the benchmarks, links every page of docs/benchmarks/ too; README.md stays within 300
  lines.
Each failure names the file, the line and the missing target.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCHMARK_PAGES = DOCS / "benchmarks"
README_MAX_LINES = 300

# Top-level folders whose paths the pages name, and top-level files named on their own.
TREE_DIRS = (
    "engine",
    "router",
    "decode_service",
    "prefill_service",
    "kv_transfer",
    "kvstore_service",
    "kernels",
    "pdmesh",
    "protos",
    "deploy",
    "tests",
    "bench",
    "docs",
)
TOP_FILES = frozenset({"Makefile", "pyproject.toml", "README.md", "BENCHMARKS.md", ".importlinter"})
# Paths a user makes, named as where to put things: not in the tree by design.
USER_MADE = frozenset({"deploy/models"})

PATH_RE = re.compile(rf"(?:{'|'.join(TREE_DIRS)})/[\w./*{{}},-]*")
MODULE_RE = re.compile(r"pdmesh(?:\.[A-Za-z_]\w*)+")
LINK_RE = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN_RE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
HEADING_RE = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR_RE = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
FENCE_RE = re.compile(r"^ {0,3}(```|~~~)")
TOKEN_SPLIT_RE = re.compile(r"[\s()\"'=;<>|`\[\]]+")
BRACES_RE = re.compile(r"\{([^{}]*)\}")


@dataclass(frozen=True)
class Problem:
    page: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.what}"


@dataclass(frozen=True)
class Page:
    path: Path
    lines: tuple[str, ...]
    # True where a line is inside a fenced code block (fence lines included).
    fenced: tuple[bool, ...]

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    @classmethod
    def read(cls, path: Path) -> Page:
        lines = tuple(path.read_text(encoding="utf-8").splitlines())
        fenced: list[bool] = []
        inside = False
        for line in lines:
            if FENCE_RE.match(line):
                fenced.append(True)
                inside = not inside
            else:
                fenced.append(inside)
        return cls(path, lines, tuple(fenced))

    def prose_paragraphs(self) -> Iterator[tuple[int, str]]:
        """(first line number, text) of each run of non-blank lines outside fenced code."""
        start, buf = 0, []
        for number, (line, fenced) in enumerate(zip(self.lines, self.fenced, strict=True), 1):
            if fenced or not line.strip():
                if buf:
                    yield start, "\n".join(buf)
                buf = []
                continue
            if not buf:
                start = number
            buf.append(line)
        if buf:
            yield start, "\n".join(buf)

    def fenced_lines(self) -> Iterator[tuple[int, str]]:
        for number, (line, fenced) in enumerate(zip(self.lines, self.fenced, strict=True), 1):
            if fenced and not FENCE_RE.match(line):
                yield number, line


def benchmark_pages() -> list[Path]:
    return sorted(BENCHMARK_PAGES.glob("*.md"))


def pages() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "BENCHMARKS.md",
        *sorted(DOCS.glob("*.md")),
        *benchmark_pages(),
    ]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Page) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line, fenced in zip(page.lines, page.fenced, strict=True):
        if fenced:
            continue
        found.update(HTML_ANCHOR_RE.findall(line))
        match = HEADING_RE.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def expand_braces(token: str) -> list[str]:
    match = BRACES_RE.search(token)
    if not match:
        return [token]
    head, tail = token[: match.start()], token[match.end() :]
    out: list[str] = []
    for choice in match.group(1).split(","):
        out.extend(expand_braces(head + choice + tail))
    return out


def path_exists(path: str) -> bool:
    if path in USER_MADE:
        return True
    if any(ch in path for ch in "*?"):
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def tree_paths(code: str) -> Iterator[str]:
    """Repository paths named in a piece of code, suffixes (`:12`, `::test`) stripped."""
    for token in TOKEN_SPLIT_RE.split(code):
        token = token.split("::", 1)[0]
        token = re.sub(r":\d+(?:-\d+)?$", "", token).rstrip(".,:")
        if token in TOP_FILES:
            yield token
            continue
        if not PATH_RE.fullmatch(token):
            continue
        for path in expand_braces(token):
            for part in path.split(","):
                if part.startswith(TREE_DIRS):
                    yield part.removesuffix("/...").removesuffix("...")


def package_dirs() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def module_problem(name: str, dirs: dict[str, Path]) -> str | None:
    """Why `pdmesh.a.b` names no module of the tree, or None when it does (or names a member)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in dirs:
            where, rest = dirs[prefix], parts[cut:]
            break
    else:
        return None
    if (
        cut == 1
        and rest
        and not (where / rest[0]).is_dir()
        and not (where / f"{rest[0]}.py").is_file()
    ):
        return None  # `pdmesh.kv.transport`: an attribute or metric name, not a module path
    for part in rest:
        if (where / part).is_dir():
            where = where / part
        elif (where / f"{part}.py").is_file():
            return None  # a module; what follows is a member of it
        elif part[0].isupper():
            return None  # a class or a proto service exported by the package
        else:
            return f"module {name} ({(where / part).relative_to(ROOT)}.py does not exist)"
    return None


def link_problems(page: Page, cache: dict[Path, set[str]]) -> Iterator[Problem]:
    for start, text in page.prose_paragraphs():
        # Code spans are not links: blank them out, keeping line breaks for the numbering.
        plain = CODE_SPAN_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
        for match in LINK_RE.finditer(plain):
            target = match.group(1)
            if re.match(r"(?:[a-z][a-z0-9+.-]*:|//)", target, re.IGNORECASE):
                continue  # http(s)://, mailto: and other schemes
            line = start + plain.count("\n", 0, match.start())
            file_part, _, anchor = target.partition("#")
            if not file_part:  # an anchor of this page
                if anchor not in anchors(page):
                    yield Problem(page.name, line, f"link to missing heading #{anchor}")
                continue
            resolved = (page.path.parent / file_part).resolve()
            if not resolved.exists():
                yield Problem(page.name, line, f"link to missing file {target}")
                continue
            if not anchor:
                continue
            if resolved.suffix != ".md" or resolved.is_dir():
                yield Problem(page.name, line, f"anchor on a non-Markdown target {target}")
                continue
            if resolved not in cache:
                cache[resolved] = anchors(Page.read(resolved))
            if anchor not in cache[resolved]:
                shown = resolved.relative_to(ROOT).as_posix()
                yield Problem(page.name, line, f"link to missing heading #{anchor} in {shown}")


def code_problems(page: Page, dirs: dict[str, Path]) -> Iterator[Problem]:
    pieces: list[tuple[int, str]] = list(page.fenced_lines())
    for start, text in page.prose_paragraphs():
        for match in CODE_SPAN_RE.finditer(text):
            pieces.append((start + text.count("\n", 0, match.start()), match.group(2)))
    for line, code in sorted(pieces):
        for path in tree_paths(code):
            if not path_exists(path):
                yield Problem(page.name, line, f"names missing path {path}")
        for name in MODULE_RE.findall(code):
            problem = module_problem(name, dirs)
            if problem:
                yield Problem(page.name, line, f"names missing {problem}")


@pytest.mark.parametrize("path", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path) -> None:
    problems = list(link_problems(Page.read(path), {}))
    assert not problems, "broken links:\n" + "\n".join(map(str, problems))


@pytest.mark.parametrize("path", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_paths_named_in_code_exist(path: Path) -> None:
    problems = list(code_problems(Page.read(path), package_dirs()))
    assert not problems, "paths that do not exist:\n" + "\n".join(map(str, problems))


def unlinked(index: Path, wanted: list[Path]) -> list[str]:
    """The pages of `wanted` (other than `index`) that `index` does not link, relative to it."""
    page = Page.read(index)
    linked = {
        (index.parent / match.group(1).partition("#")[0]).resolve()
        for _, text in page.prose_paragraphs()
        for match in LINK_RE.finditer(text)
    }
    return [
        path.relative_to(index.parent).as_posix()
        for path in wanted
        if path.resolve() != index.resolve()
        if path.resolve() not in linked
    ]


def test_docs_index_lists_every_page() -> None:
    missing = unlinked(DOCS / "README.md", [*sorted(DOCS.glob("*.md")), *benchmark_pages()])
    assert not missing, f"docs/README.md:1: does not link {', '.join(missing)}"


def test_benchmarks_page_links_every_topic_page() -> None:
    assert benchmark_pages(), "docs/benchmarks/ holds no page"
    missing = unlinked(ROOT / "BENCHMARKS.md", benchmark_pages())
    assert not missing, f"BENCHMARKS.md:1: does not link {', '.join(missing)}"


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md:{lines}: {lines} lines, over {README_MAX_LINES}"


def test_the_checks_catch_what_they_should() -> None:
    """The checker itself: a bad link, a bad anchor, a bad path and a bad module are each found."""
    page_path = DOCS / "README.md"
    bad = Page(
        page_path,
        (
            "# Title",
            "[ok](../README.md) [gone](no-such-page.md) [x](../README.md#no-such-heading)",
            "[self](#title) see `engine/no_such_module.py:12` and `tests/test_mesh.py::test_x`",
            "```sh",
            "python -m pdmesh.engine.no_such_module",
            "```",
        ),
        (False, False, False, True, True, True),
    )
    found = [str(p) for p in link_problems(bad, {})]
    assert found == [
        "docs/README.md:2: link to missing file no-such-page.md",
        "docs/README.md:2: link to missing heading #no-such-heading in README.md",
    ]
    found = [str(p) for p in code_problems(bad, package_dirs())]
    assert found == [
        "docs/README.md:3: names missing path engine/no_such_module.py",
        "docs/README.md:5: names missing module pdmesh.engine.no_such_module"
        " (engine/no_such_module.py does not exist)",
    ]
    # A topic page two folders down: links resolve from its own folder.
    nested = Page(
        BENCHMARK_PAGES / "x.md",
        ("[up](../../BENCHMARKS.md#headline-figures) [wrong depth](../BENCHMARKS.md)",),
        (False,),
    )
    found = [str(p) for p in link_problems(nested, {})]
    assert found == ["docs/benchmarks/x.md:1: link to missing file ../BENCHMARKS.md"]
    assert unlinked(DOCS / "README.md", [BENCHMARK_PAGES / "no-such-page.md"]) == [
        "benchmarks/no-such-page.md"
    ]
    assert slug("CPU: pdmesh against vLLM's CPU build (issue 21, 2026-11-25)") == (
        "cpu-pdmesh-against-vllms-cpu-build-issue-21-2026-11-25"
    )
    assert slug("`pdmesh up` and its flags") == "pdmesh-up-and-its-flags"
    assert expand_braces("a/{b,c}-{d,e}.json") == [
        "a/b-d.json",
        "a/b-e.json",
        "a/c-d.json",
        "a/c-e.json",
    ]
