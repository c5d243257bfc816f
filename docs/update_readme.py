"""Regenerate the README's configuration table from bus.config (``python docs/update_readme.py``)."""

import pathlib

from diloco.cli import load_role_configs
from bus.config import markdown_table

START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def main() -> None:
    load_role_configs()
    p = pathlib.Path(__file__).resolve().parent.parent / "README.md"
    s = p.read_text()
    a, b = s.index(START) + len(START), s.index(END)
    p.write_text(s[:a] + "\n" + markdown_table() + "\n" + s[b:])


if __name__ == "__main__":
    main()
