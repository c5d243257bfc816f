"""The README as CI and a reader use it: its test and check commands are the ones `.ci/run` runs, it
stays short, and the pages it and docs/RESULTS.md link to exist."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_readme_commands_are_the_ones_ci_runs():
    readme = (ROOT / "README.md").read_text().splitlines()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python -m pytest -q" in readme and "python -m pytest -q" in ci
    checks = "ruff check . && mypy && lint-imports"
    assert any(checks in line for line in readme) and checks in ci


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160


def test_relative_links_resolve():
    for page in ("README.md", "docs/RESULTS.md", "docs/configuration.md", "docs/BENCHMARKS.md"):
        path = ROOT / page
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{page} links to {target}, which does not exist"
