"""The README and the docs it links: the configuration table documents every setting with the
real default, every page is linked from the README, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

from nextstate.core.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
README_MAX_LINES = 200  # a newcomer reads it in five minutes; the rest is in docs/


def test_every_setting_is_in_the_readme_table():
    rows = dict(re.findall(r"^\| `(NEXTSTATE_[A-Z_]+)` \| ([^|]+) \|", CONFIGURATION.read_text(), re.MULTILINE))
    expected = {f"NEXTSTATE_{name.upper()}" for name, _ in Settings.fields()}
    assert expected - rows.keys() == set(), "settings missing from docs/configuration.md"
    assert rows.keys() - expected == set(), "docs/configuration.md rows for settings that do not exist"
    for name, field in Settings.fields():
        default = field.default
        if isinstance(default, (bool, int, float)) and not isinstance(default, bool):
            shown = rows[f"NEXTSTATE_{name.upper()}"].strip().strip("`")
            assert float(shown) == float(default), f"NEXTSTATE_{name.upper()}: the table says {shown}, code {default}"


def test_the_deploy_files_name_only_settings_that_exist():
    """A misspelt variable in a compose file or unit is ignored in silence by the process."""
    expected = {f"NEXTSTATE_{name.upper()}" for name, _ in Settings.fields()}
    deploy = ROOT / "deploy"
    for path in sorted(deploy.iterdir()):
        named = set(re.findall(r"\bNEXTSTATE_[A-Z_]+\b", path.read_text()))
        assert named - expected == set(), f"{path.name} names settings that do not exist"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as dashes."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_short_and_links_every_page_of_the_docs():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES
    linked = {(README.parent / target).resolve() for target, _ in LINK.findall(README.read_text())
              if not target.startswith("http")}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), "docs pages the README does not link"


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    for page in [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = (page.parent / target).resolve()
            assert path.exists(), f"{page.name}: {target} does not exist"
            if anchor and path.suffix == ".md":
                assert anchor in anchors(path), f"{page.name}: {target}#{anchor} names no heading"


def test_the_engine_settings_old_names_are_still_read(monkeypatch, caplog):
    """NEXTSTATE_SGLANG_TIMEOUT_S / _RETRIES became NEXTSTATE_ENGINE_* when vLLM joined: a deploy
    that sets the old names keeps working, and the log says what to set instead."""
    monkeypatch.setenv("NEXTSTATE_SGLANG_RETRIES", "5")
    monkeypatch.setenv("NEXTSTATE_SGLANG_TIMEOUT_S", "30")
    with caplog.at_level("WARNING"):
        engine = Settings().engine
    assert (engine.engine_retries, engine.engine_timeout_s) == (5, 30.0)
    assert "NEXTSTATE_SGLANG_RETRIES is deprecated: set NEXTSTATE_ENGINE_RETRIES" in caplog.text
    monkeypatch.setenv("NEXTSTATE_ENGINE_RETRIES", "3")
    assert Settings().engine.engine_retries == 3, "the new name wins"
