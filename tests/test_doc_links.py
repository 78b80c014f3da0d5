"""Docs that name each other and the code's pointers into docs/ resolve.

Every relative link in the repository's Markdown files must name a file that exists and, with
a ``#fragment``, a heading of that file (GitHub's anchor rule: lower case, punctuation other
than ``-`` and ``_`` dropped, spaces to ``-``, repeats numbered ``-1``, ``-2``). Every
``docs/<name>.md`` that code, tests, benchmarks or examples mention (a comment, an error
message) must exist, so renaming a doc without its pointers fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# runs/ holds training output; dot folders (.git, caches, virtual environments) are not ours
SKIP = {"runs", "build", "dist", "node_modules"}
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOC_PATH = re.compile(r"docs/[\w./-]+\.md")


def _files(suffix: str) -> list[Path]:
    def ours(path: Path) -> bool:
        folders = path.relative_to(ROOT).parts[:-1]
        return not any(f in SKIP or f.startswith(".") or f.endswith(".egg-info") for f in folders)

    return sorted(p for p in ROOT.rglob(f"*{suffix}") if ours(p))


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    in_code = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = re.match(r"#+ (.*)", line)
        if in_code or heading is None:
            continue
        slug = _anchor(heading.group(1))
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_anchor_rule():
    assert _anchor("ps_train's MLP 1+1 step: where it goes") == "ps_trains-mlp-11-step-where-it-goes"
    assert _anchor("Dynamic groups (`world_size=None`)") == "dynamic-groups-world_sizenone"


def test_markdown_links_resolve():
    broken = []
    for md in _files(".md"):
        for number, line in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
            for link in LINK.findall(line):
                if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
                    continue
                path, _, fragment = link.partition("#")
                target = (md.parent / path).resolve() if path else md
                where = f"{md.relative_to(ROOT)}:{number}: {link}"
                if not target.exists():
                    broken.append(f"{where} (no such file)")
                elif fragment and target.suffix == ".md" and fragment not in _anchors(target):
                    broken.append(f"{where} (no heading with that anchor in {target.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_named_in_code_exist():
    missing = []
    for py in _files(".py"):
        for number, line in enumerate(py.read_text(encoding="utf-8").splitlines(), 1):
            for name in DOC_PATH.findall(line):
                if not (ROOT / name).exists():
                    missing.append(f"{py.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "docs named in code that do not exist:\n" + "\n".join(missing)
