#!/usr/bin/env python3
"""Write the mount options' table of docs/READER.md ("Options") from the
one table of them in the code (verneuil_fuse/cli/mount_options.py): run it
after changing an option; tests/test_mount_cli.py fails while the two
disagree.

    .venv/bin/python scripts/mount_options_doc.py [--check]
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from verneuil_fuse.cli.mount_options import docs_table  # noqa: E402

READER_MD = os.path.join(HERE, "..", "docs", "READER.md")
HEADER = "| option | default | meaning |\n"


def split(text: str) -> tuple[str, str, str]:
    """(before, the table, after) of docs/READER.md's text."""
    start = text.index(HEADER)
    end = text.index("\n\n", start) + 1
    return text[:start], text[start:end], text[end:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only say whether the docs' table is the code's")
    args = p.parse_args()
    with open(READER_MD, encoding="utf-8") as f:
        before, table, after = split(f.read())
    if table == docs_table():
        return 0
    if args.check:
        print("docs/READER.md's table of mount options differs from the code's: run %s" % sys.argv[0])
        return 1
    with open(READER_MD, "w", encoding="utf-8") as f:
        f.write(before + docs_table() + after)
    print("wrote the table of mount options in docs/READER.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
