"""The front door: README.md's set-up commands are the ones CI runs, and every link in the README
and docs/ leads to a file that exists and, with an anchor, to a heading in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```bash\n(.*?)```", re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_setup_has_the_two_commands_ci_runs():
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set-up on a fresh machine"):]
    setup = setup[:setup.index("\n## ", 1)]
    commands = [block.strip() for block in FENCE.findall(setup)]
    assert commands == ["pip install torch==2.13.0 -e . && dflash-offline demo --out runs/demo",
                        "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q"], commands
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_links_lead_somewhere():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == [], "\n".join(broken)


def test_no_readme_paragraph_runs_over_twelve_lines():
    """A newcomer reads the README: prose in paragraphs (and list items) of at most 12 lines;
    tables and code blocks are not prose."""
    long, block, in_code = [], [], False
    for n, line in enumerate((ROOT / "README.md").read_text().splitlines() + [""], 1):
        if line.startswith("```"):
            in_code = not in_code
            block = []
            continue
        prose = not in_code and line.strip() and not line.startswith("|")
        if prose and not (line.startswith("- ") and block):
            block.append(n)
        elif prose:  # a new list item starts a new block
            if len(block) > 12:
                long.append((block[0], len(block)))
            block = [n]
        else:
            if len(block) > 12:
                long.append((block[0], len(block)))
            block = []
    assert not long, f"README paragraphs over 12 lines (first line, length): {long}"
