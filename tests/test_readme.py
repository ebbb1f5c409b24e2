"""The README's configuration table documents every setting, with the real default."""

from __future__ import annotations

import re
from pathlib import Path

from nextstate.core.settings import Settings

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_setting_is_in_the_readme_table():
    rows = dict(re.findall(r"^\| `(NEXTSTATE_[A-Z_]+)` \| ([^|]+) \|", README.read_text(), re.MULTILINE))
    expected = {f"NEXTSTATE_{name.upper()}" for name, _ in Settings.fields()}
    assert expected - rows.keys() == set(), "settings missing from the README"
    assert rows.keys() - expected == set(), "README rows for settings that do not exist"
    for name, field in Settings.fields():
        default = field.default
        if isinstance(default, (bool, int, float)) and not isinstance(default, bool):
            shown = rows[f"NEXTSTATE_{name.upper()}"].strip().strip("`")
            assert float(shown) == float(default), f"NEXTSTATE_{name.upper()}: README says {shown}, code {default}"


def test_the_deploy_files_name_only_settings_that_exist():
    """A misspelt variable in a compose file or unit is ignored in silence by the process."""
    expected = {f"NEXTSTATE_{name.upper()}" for name, _ in Settings.fields()}
    deploy = README.parent / "deploy"
    for path in sorted(deploy.iterdir()):
        named = set(re.findall(r"\bNEXTSTATE_[A-Z_]+\b", path.read_text()))
        assert named - expected == set(), f"{path.name} names settings that do not exist"
