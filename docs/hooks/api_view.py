"""MkDocs hook: the API reference reads the package as it installs.

`handlers/`, `algorithms/` and `scenarios/` sit at the top of the source tree and install as
`fedcore.handlers`, `fedcore.algorithms` and `fedcore.scenarios` (setup.cfg's package_dir), a
mapping mkdocstrings cannot follow. Before the build, this hook assembles that layout from links
in `build/api_view/` (as `.ci/lint-layers` does for the import contracts), which mkdocs.yml names
as the path mkdocstrings reads."""
from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VIEW = ROOT / "build" / "api_view"
PLUGINS = ("handlers", "algorithms", "scenarios")


def on_startup(command, dirty) -> None:
    shutil.rmtree(VIEW, ignore_errors=True)
    package = VIEW / "fedcore"
    package.mkdir(parents=True)
    for entry in (ROOT / "fedcore").iterdir():
        if entry.name not in PLUGINS and entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in PLUGINS:
        (package / name).symlink_to(ROOT / name)
