#!/usr/bin/env python3
"""Checks the relative links of the repository's Markdown files: every
[text](path) and [text](path#anchor) must name a file or folder that
exists, and an anchor must be a heading of that file (GitHub's slugs).
Links to other sites are not followed. Prints each broken link and exits
1 if there is one.

    python3 scripts/check_doc_links.py [--allow-missing PATH ...]
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set:
    out, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m and not fenced:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def main() -> int:
    allow = set(sys.argv[sys.argv.index("--allow-missing") + 1:]) if "--allow-missing" in sys.argv else set()
    files = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = 0
    for f in files:
        fenced = False
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if FENCE.match(line):
                fenced = not fenced
            if fenced:
                continue
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                dest = (f.parent / path).resolve() if path else f
                rel = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
                if not dest.exists():
                    if str(rel) not in allow:
                        print(f"{f.relative_to(ROOT)}:{n}: {target}: no such file")
                        bad += 1
                    continue
                if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    print(f"{f.relative_to(ROOT)}:{n}: {target}: no heading #{anchor}")
                    bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
