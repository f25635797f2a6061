"""The links of the Markdown pages a reader follows (README.md, docs/*.md, bench/RESULTS.md and its
history), checked without the network: `make lint` runs `python -m tests.check_links`.

- A relative link must name a file or folder of the checkout, inside it; `#anchor` (alone or after a
  Markdown file) must be one of that file's headings, slugged as GitHub slugs them.
- An http(s) link is not dialled (the checks run offline), only read: a scheme, a host, no spaces.
- Every page under docs/ is linked from README.md, so none is reachable only by search.

Code (fenced blocks and `spans`) is not prose: a `[x](y)` or `# comment` there is neither a link nor
a heading.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
README = "README.md"

FENCE = re.compile(r"^ {0,3}(```|~~~)")
SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets (a badge).
TARGET = r"<?([^\s()<>]*(?:\([^\s()]*\)[^\s()<>]*)*)>?"  # a URL may hold balanced parentheses
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*" + TARGET + r"(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
AUTOLINK = re.compile(r"<(https?://[^>]*)>")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
HOST = re.compile(r"^(localhost|[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+|\[[0-9a-fA-F:.]+\])(:\d+)?$")


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code, with inline code blanked."""
    lines, fence = [], ""
    for number, line in enumerate(text.splitlines(), 1):
        if match := FENCE.match(line):
            if not fence:
                fence = match.group(1)
            elif line.strip().startswith(fence):
                fence = ""
            continue
        if not fence:
            lines.append((number, SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text as rendered (links as their text, no code ticks or
    emphasis marks, no HTML), lower-cased, punctuation but `-` and `_` dropped, spaces as `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return "".join(c for c in text.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a Markdown file: its headings' slugs (a repeated one as GitHub numbers it:
    x, x-1, x-2) and the ids of its HTML anchors."""
    text = path.read_text()
    seen: Counter[str] = Counter()
    found = set(HTML_ID.findall(text))
    outside_code = {number for number, _ in prose(text)}
    for number, line in enumerate(text.splitlines(), 1):
        if number in outside_code and (match := HEADING.match(line)):
            base = slug(match.group(2))
            found.add(f"{base}-{seen[base]}" if seen[base] else base)
            seen[base] += 1
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link in the prose."""
    found = []
    for number, line in prose(text):
        for pattern in (INLINE, AUTOLINK):
            found += [(number, match.group(1)) for match in pattern.finditer(line)]
        if match := DEFINITION.match(line):
            found.append((number, match.group(1)))
    return found


def external_problem(target: str) -> str | None:
    parts = urlsplit(target)
    if parts.scheme == "mailto":
        return None if "@" in parts.path else "a mailto: link without an address"
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme!r} is neither http(s) nor mailto"
    if not HOST.match(parts.netloc):
        return f"{parts.netloc!r} is not a host name"
    return None


def problem(page: Path, target: str, root: Path) -> str | None:
    """What is wrong with one link of `page`, or None."""
    if not target:
        return "an empty link"
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):
        return external_problem(target)
    path, _, anchor = target.partition("#")
    file = (page.parent / unquote(path)).resolve() if path else page
    if path.startswith("/"):
        return "an absolute path (GitHub resolves it from the site's root, not the repository's)"
    if not file.is_relative_to(root.resolve()):
        return "leaves the repository"
    if not file.exists():
        return f"{file.relative_to(root.resolve())} does not exist"
    if anchor and file.suffix == ".md" and unquote(anchor) not in anchors(file):
        return f"no heading of {file.relative_to(root.resolve())} has the anchor #{anchor}"
    return None


def pages(root: Path) -> list[Path]:
    history = sorted((root / "bench" / "history").glob("*.md"))
    return [root / README, *sorted((root / "docs").glob("*.md")), root / "bench" / "RESULTS.md", *history]


def check(root: Path) -> list[str]:
    """`page:line: target: what is wrong` for every broken link, then every docs page README.md does
    not link."""
    found = []
    linked_from_readme = set()
    for page in pages(root):
        if not page.exists():
            continue
        name = page.relative_to(root)
        for number, target in links(page.read_text()):
            if (what := problem(page, target, root)) is not None:
                found.append(f"{name}:{number}: {target}: {what}")
            elif page.name == README and page.parent == root:
                linked_from_readme.add((page.parent / unquote(target.partition("#")[0])).resolve())
    for doc in sorted((root / "docs").glob("*.md")):
        if doc.resolve() not in linked_from_readme:
            found.append(f"{doc.relative_to(root)}: not linked from {README}")
    return found


def main() -> int:
    found = check(ROOT)
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
