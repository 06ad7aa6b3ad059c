"""The documentation site (mkdocs.yml, docs/) builds with warnings as errors, and that build
fails on what a reader would trip on: a broken link, a reference to a name that does not exist.
The API reference lists every public name."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings")


def _build(project: Path, out: Path) -> subprocess.CompletedProcess[str]:
    # not -q: mkdocs then drops the warnings before --strict counts them
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=project, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "CheckpointManager" in api and "restore" in api  # generated from the docstrings


def test_a_broken_link_or_reference_fails_the_build(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", project)
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copytree(ROOT / "ckptio", project / "ckptio")
    page = project / "docs" / "getting-started.md"
    page.write_text(page.read_text() + "\nSee [the lost page](guides/no-such-page.md).\n")
    done = _build(project, tmp_path / "site")
    assert done.returncode != 0 and "no-such-page.md" in done.stdout + done.stderr
    page.write_text(page.read_text().replace("[the lost page](guides/no-such-page.md)", "x"))
    api = project / "docs" / "reference" / "api.md"
    api.write_text(api.read_text() + "\n::: ckptio.api.NoSuchName\n")
    done = _build(project, tmp_path / "site2")
    assert done.returncode != 0 and "NoSuchName" in done.stdout + done.stderr


def test_the_api_reference_lists_every_public_name() -> None:
    import ckptio

    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    listed = {line.split()[-1].rsplit(".", 1)[-1] for line in page.splitlines()
              if line.startswith("::: ")}
    missing = set(ckptio.__all__) - {"__version__"} - listed
    assert not missing, f"docs/reference/api.md lacks {sorted(missing)}"
