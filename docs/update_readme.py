"""Regenerate the table of every variable in docs/configuration.md from bus.config
(``python docs/update_readme.py``; the name is historical: the table used to live in the README)."""

import pathlib

from diloco.cli import load_role_configs
from bus.config import markdown_table

START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"
PAGE = pathlib.Path(__file__).resolve().parent / "configuration.md"


def main() -> None:
    load_role_configs()
    s = PAGE.read_text()
    a, b = s.index(START) + len(START), s.index(END)
    PAGE.write_text(s[:a] + "\n" + markdown_table() + "\n" + s[b:])


if __name__ == "__main__":
    main()
