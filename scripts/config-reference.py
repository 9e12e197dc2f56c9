#!/usr/bin/env python3
"""Builds the configuration reference table of docs/configuration.md from packaging/config.toml,
the commented reference configuration, so the two cannot drift apart.

  scripts/config-reference.py           rewrite the table in docs/configuration.md
  scripts/config-reference.py --check   exit 1 if docs/configuration.md's table is stale (CI)
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
REFERENCE = "docs/configuration.md"
KEY = re.compile(r'^(#\s*)?([a-z_]+)\s*=\s*(.+?)\s*$')


LITERAL = re.compile(r'^("[^"]*"|\d[\w.]*|true|false|\[.*\])$')


def rows(text):
    section, comment, first_key, out = "(top level)", [], None, []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            section, comment, first_key = line, [], None
            continue
        if not line:
            comment, first_key = [], None
            continue
        m = KEY.match(line)
        value = m.group(3).split(" #")[0].strip() if m else ""
        if m and LITERAL.match(value):
            default = "unset" if m.group(1) else value
            desc = " ".join(comment).strip()
            if desc:
                first_key = m.group(2)
            elif first_key:
                desc = f"see `{first_key}`"
            out.append((section, m.group(2), default, desc))
            comment = []
            continue
        if line.startswith("#"):
            comment.append(line.lstrip("#").strip())
    return out


def table(text):
    lines = ["| section | key | default | what it does |", "|---|---|---|---|"]
    for section, key, default, desc in rows(text):
        desc = desc.replace("|", "\\|")
        lines.append(f"| `{section}` | `{key}` | `{default}` | {desc} |")
    return "\n".join(lines)


def main():
    cfg = (ROOT / "packaging/config.toml").read_text()
    readme_path = ROOT / REFERENCE
    readme = readme_path.read_text()
    if START not in readme or END not in readme:
        sys.exit(f"{REFERENCE} lacks the {START} / {END} markers")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{table(cfg)}\n{END}{tail}"
    if "--check" in sys.argv:
        if new != readme:
            sys.exit(f"{REFERENCE}'s configuration reference is stale: run scripts/config-reference.py")
        return
    readme_path.write_text(new)


if __name__ == "__main__":
    main()
