"""Where every benchmark's result goes: a JSON and a PNG in bench/results/, a row in BENCHMARKS.md.

One place for this so every result names the machine it ran on the same way, and a result
from a GPU never overwrites the one from the CPU box (its file name carries the GPU).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "BENCHMARKS.md"
LOG_HEADING = "## Results log"
LOG_HEADER = "| date | benchmark | model | machine | headline | result |\n| --- | --- | --- | --- | --- | --- |\n"


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no torch or a broken driver: describe the CPU only
        return None


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        memory = f", {mem:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        memory = ""
    gpu = _gpu_name()
    return f"{os.cpu_count()} CPU cores ({cpu}){memory}, " + (f"GPU: {gpu}" if gpu else "no GPU")


def result_stem(benchmark: str, model: str | None = None, variant: str | None = None) -> str:
    """`<benchmark>[-<model>][-<variant>][-<gpu>]`: CPU and GPU runs of one bench, and runs
    with other settings (`variant`), keep separate files."""
    parts = [benchmark] + [p for p in (model, variant) if p]
    gpu = _gpu_name()
    if gpu:
        parts.append(re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-"))
    return "-".join(parts)


def save(result: dict) -> Path:
    """Write <stem>.json, then its PNG and BENCHMARKS.md row (see `render`).

    `result` needs "benchmark" (the bench module's name) and may have "model" and "variant";
    machine and date are added here.
    """
    result.setdefault("machine", machine())
    result.setdefault("date", time.strftime("%Y-%m-%d"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{result_stem(result['benchmark'], result.get('model'), result.get('variant'))}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    render(out)
    print(f"written to {out} and {out.with_suffix('.png').name}")
    return out


def render(path: Path) -> None:
    """Draw a result's PNG and write its BENCHMARKS.md row with the bench module's own
    `plot(result)` and `headline(result)`, so both can be redrawn from the JSON alone."""
    result = json.loads(path.read_text())
    bench = importlib.import_module(f"bench.{result['benchmark']}")
    figure = bench.plot(result)
    figure.tight_layout()
    figure.savefig(path.with_suffix(".png"), dpi=110)
    pyplot().close(figure)
    row = (
        f"| {result['date']} | {result['benchmark']} | {' '.join(filter(None, (result.get('model'), result.get('variant')))) or '—'} "
        f"| {result['machine']} "
        f"| {bench.headline(result)} | [json](bench/results/{path.name}) [png](bench/results/{path.stem}.png) |"
    )
    upsert_row(BENCHMARKS, path.name, row)


def upsert_row(path: Path, key: str, row: str) -> None:
    """Replace the log row that links `key`, or append one; the log table is made if missing."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if LOG_HEADING not in text:
        text = text.rstrip("\n") + f"\n\n{LOG_HEADING}\n\nOne row per result file, written by the bench scripts.\n\n{LOG_HEADER}"
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and f"bench/results/{key})" in line:
            lines[i] = row
            break
    else:
        start = lines.index(LOG_HEADING)
        end = start + 1
        while end < len(lines) and not (lines[end].startswith("## ") and end > start):
            end += 1
        while lines[end - 1] == "":
            end -= 1
        lines.insert(end, row)
    path.write_text("\n".join(lines) + "\n")


def pyplot():
    """matplotlib's pyplot without a display (the bench extra installs it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


if __name__ == "__main__":  # python -m bench.report: redraw every PNG and row from the JSONs
    for found in sorted(RESULTS.glob("*.json")):
        render(found)
        print(f"rendered {found.name}")
