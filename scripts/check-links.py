#!/usr/bin/env python3
"""Checks that every relative Markdown link in the repository's documents resolves: the file or
folder it names exists, and its `#anchor` is a heading of that file (GitHub's rules: lower
case, punctuation dropped, spaces to hyphens, `-1`, `-2` for repeats) or an explicit
`<a id=...>` / `<a name=...>`. External links (http, https, mailto) are not fetched.

  scripts/check-links.py            exit 1 and list each broken link as file:line: target
  scripts/check-links.py FILE...    check only these files (their targets may be anywhere)

Stdlib only, so CI (.ci/run) and `cargo test --test layout` run it on a fresh machine.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Every Markdown file of the repository outside build output and hidden folders.
SKIP_DIRS = {"target", "node_modules", ".git"}
INLINE = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
EXPLICIT = re.compile(r"<a\s+(?:id|name)\s*=\s*\"([^\"]+)\"", re.IGNORECASE)
FENCE = re.compile(r"^\s{0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def documents():
    out = []
    stack = [ROOT]
    while stack:
        d = stack.pop()
        for p in sorted(d.iterdir()):
            if p.is_dir():
                if p.name not in SKIP_DIRS and not p.name.startswith("."):
                    stack.append(p)
            elif p.suffix == ".md":
                out.append(p)
    return sorted(out)


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"<[^>]+>", "", heading)  # inline HTML
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # punctuation, backticks, emphasis
    return text.replace(" ", "-")


def prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fenced = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fenced is None:
                fenced = m.group(1)
            elif m.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            yield n, line


def anchors(path, cache={}):
    if path not in cache:
        seen, out = {}, set()
        for _, line in prose_lines(path.read_text(encoding="utf-8")):
            m = re.match(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if m:
                base = slug(m.group(2))
                k = seen.get(base, 0)
                out.add(base if k == 0 else f"{base}-{k}")
                seen[base] = k + 1
            out.update(a.lower() for a in EXPLICIT.findall(line))
        cache[path] = out
    return cache[path]


def targets(line, after_blank):
    """Link targets on a line; a reference definition only opens a paragraph."""
    plain = CODE_SPAN.sub("", line)
    found = INLINE.findall(plain)
    m = REFDEF.match(plain) if after_blank else None
    if m:
        found.append(m.group(1))
    return found


def broken(doc):
    out = []
    previous = ""
    for n, line in prose_lines(doc.read_text(encoding="utf-8")):
        after_blank, previous = not previous.strip(), line
        for t in targets(line, after_blank):
            if re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE):
                continue  # http:, https:, mailto:
            file_part, _, anchor = t.partition("#")
            target = doc if not file_part else (doc.parent / file_part).resolve()
            if not target.exists():
                out.append(f"{doc.relative_to(ROOT)}:{n}: {t} (no such file)")
            elif anchor and target.suffix == ".md" and anchor.lower() not in anchors(target):
                out.append(f"{doc.relative_to(ROOT)}:{n}: {t} (no such heading)")
    return out


def main():
    docs = [Path(a).resolve() for a in sys.argv[1:]] or documents()
    bad = [b for d in docs for b in broken(d)]
    if bad:
        print("broken links:\n" + "\n".join(bad), file=sys.stderr)
        sys.exit(1)
    print(f"links: {len(docs)} documents checked, all resolve")


if __name__ == "__main__":
    main()
