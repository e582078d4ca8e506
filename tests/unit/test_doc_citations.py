"""Docs and comments cite only what is in the repository: no design document or folder outside it.

The design the code cites lives in docs/architecture.md (§1-§10); a reference to a file a user of
the repository does not have (the old design document, a folder beside the checkout, the seed documents) fails here.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
THIS = pathlib.Path(__file__).resolve()
TEXT = {".py", ".md", ".toml", ".sh", ".conf", ".cfg", ".yaml", ".yml", ".txt", ".ini", ""}
OUTSIDE = re.compile(r"\bDESIGN\b|(?i:\bdesign\.md|\bstyle\.md|\bseeds?[ /_-]?0\d\d)|(?<![\w.-])shared/"
                     r"|(?:\.\./|/work/)shared\b")


def tracked() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [ROOT / line for line in out.splitlines() if line]


def test_no_citation_of_documents_outside_the_repository():
    hits = []
    for path in tracked():
        if path.resolve() == THIS or path.suffix not in TEXT or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "cite docs/architecture.md §N instead:\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_must():
    assert OUTSIDE.search("The replica state machine of DESIGN §4")
    assert OUTSIDE.search("see ../shared/DESIGN.md")
    assert OUTSIDE.search("copied from shared/STYLE.md")
    assert OUTSIDE.search("one worker per replica (seed 000)")
    assert OUTSIDE.search('"""Seed 000\'s processor status."""')
    assert OUTSIDE.search("Seeds 000 and 002; seed-002")
    assert OUTSIDE.search("the layout of Design.md §2")
    assert OUTSIDE.search("see ../shared for the background")
    assert OUTSIDE.search("examples in /work/shared")
    assert OUTSIDE.search("as STYLE.md says")
    assert not OUTSIDE.search("docs/architecture.md §4; a shared lock; designed")
    assert not OUTSIDE.search("sorted by id, rotated by the seed; seed=0; the seed breaks ties; a seed of 0")
