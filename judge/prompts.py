"""Judge prompts as files in prompts/, loaded by name and filled with `string.Template`."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from string import Template

# The prompts ship as package data (`nextstate.prompts`), so a wheel finds them where an
# editable checkout does.
BUNDLED = Path(str(files("nextstate.prompts")))


class PromptLibrary:
    """Each prompt is read once, when first used: the judge renders two per judged turn on the
    event loop that serves users, where four file reads each were a tenth of its own time.
    Editing a prompt therefore takes a restart, as every other setting does."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or BUNDLED
        if not self.directory.is_dir():
            raise FileNotFoundError(f"judge prompt folder {self.directory} does not exist")
        self._templates: dict[str, tuple[Template, Template]] = {}

    def names(self) -> list[str]:
        return sorted(p.name.removesuffix(".system.txt") for p in self.directory.glob("*.system.txt"))

    def has(self, name: str) -> bool:
        return all((self.directory / f"{name}.{part}.txt").is_file() for part in ("system", "user"))

    def require(self, name: str) -> None:
        for part in ("system", "user"):
            if not (self.directory / f"{name}.{part}.txt").is_file():
                raise FileNotFoundError(
                    f"judge prompt '{name}' needs {name}.{part}.txt in {self.directory} (have: {', '.join(self.names())})"
                )

    def source(self, name: str) -> str:
        """The prompt's files as they are on disk (what a calibration verdict depends on)."""
        self.require(name)
        return "\n".join((self.directory / f"{name}.{part}.txt").read_text(encoding="utf-8") for part in ("system", "user"))

    def render(self, name: str, **values: str) -> list[dict[str, str]]:
        """Chat messages for the judge. Unknown placeholders are an error, not silent text."""
        if name not in self._templates:
            self.require(name)
            read = lambda part: Template((self.directory / f"{name}.{part}.txt").read_text(encoding="utf-8").strip())  # noqa: E731
            self._templates[name] = (read("system"), read("user"))
        system, user = self._templates[name]
        return [{"role": "system", "content": system.substitute(values)}, {"role": "user", "content": user.substitute(values)}]
