"""Results read back: a run's summary and headline, the curves across seeds, the tables the log
quotes, and the plot."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict
from pathlib import Path

from nextstate.learner.readings import repetition

from bench.personalization.evaluation import (
    LENGTH_MATCHED_WORDS,
    by_window,
    mean_repetition,
    sensible_scores,
    standard_error,
    updates_to_reach,
    without_samples,
)
from bench.personalization.run import ModeRun
from bench.report import pyplot


def seeds_report(paths: list[str]) -> None:
    """Runs of several seeds grouped by preference and mode: the mean and spread (sample
    standard deviation) of first-reply success per window of WINDOW tasks, the updates needed
    to reach 0.8, the final evaluation's score, and text quality (repeated words, held-out
    perplexity against the base model's) — the table issue 38 asks for."""
    groups: dict[tuple[str, str, str], list[tuple[int, dict, dict]]] = {}
    for path in paths:
        result = json.loads(Path(path).read_text())
        # runs of one setting differ only by seed: their variants by the "-seedN" suffix
        setting = re.sub(r"-seed\d+$", "", result.get("variant") or "")
        for run, summary in zip(result["runs"], result["summary"]):
            key = (result["preference"]["instruction"], summary["mode"], setting)
            groups.setdefault(key, []).append((result["settings"]["seed"], run, summary))

    def curve_of(curves: list[list[float]]) -> str:
        curves = [c for c in curves if c]
        return " · ".join(spread([c[i] for c in curves if i < len(c)]) for i in range(max(map(len, curves)))) \
            if curves else "—"

    print("| preference | mode | setting | seeds | success per window of 16 tasks (mean ± sd over seeds) "
          "| the same, sensible replies only | updates to 0.8 "
          "(per seed) | final version | final score | repeated words, final | perplexity, final / base "
          "| surprise to the base model, final (nats/token) | final score, sensible replies only "
          f"| held-out questions: base model → first version after {RATINGS} ratings (its ratings) → final "
          "| held-out final, sensible replies only |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    pooled: list[dict] = []
    for (instruction, mode, setting), runs in groups.items():
        for _, run, _ in runs:
            pooled += figures_against_success(run["tasks"], run.get("steps", []), run.get("prose_forgetting"))
        # from the tasks: older result files have no summary of either
        curve = curve_of([by_window([t["score"] for t in run["tasks"]]) for _, run, _ in runs])
        sensible = curve_of([by_window(scores) for _, run, _ in runs if (scores := sensible_scores(run["tasks"]))])
        finals = [s["final"] for _, _, s in runs if s.get("final")]
        reached = [updates_to_reach(run["tasks"]) for _, run, _ in runs]
        reach = ", ".join("never" if r is None else str(r) for r in reached)
        versions = ", ".join(f"v{f['version']}" for f in finals)
        print(f"| {instruction} | {mode} | {setting or '—'} | {', '.join(str(seed) for seed, _, _ in runs)} | {curve} "
              f"| {sensible} | "
              f"{reach} | {versions} | {spread([f['score'] for f in finals])} | {spread([f.get('repetition') for f in finals])} | "
              f"{spread([f.get('perplexity_ratio') for f in finals])} | {spread([f.get('surprise') for f in finals])} | "
              f"{spread([f.get('score_sensible') for f in finals])} | {held_out_column(runs)} "
              f"| {spread([(f.get('held_out') or {}).get('score_sensible') for f in finals])} |")
    for (_, mode, setting), runs in groups.items():
        if (line := held_out_by_then(runs)) is not None:
            print(f"held-out questions, {setting or mode}: {line}")
    for figure in ("gain", "accepted", "rejected", "wish"):
        if (r := gain_correlation(pooled, figure)) is not None:
            versions = sum(1 for row in pooled if row.get(figure) is not None)
            print(f"held-out {figure} against measured success, over {versions} versions of these runs: Pearson's r = {r}")
    if (r := gain_correlation(pooled, "forgetting", "prose_forgetting")) is not None:
        versions = sum(1 for row in pooled if row.get("forgetting") is not None and row.get("prose_forgetting") is not None)
        print(f"the gate's forgetting against the bench's held-out prose, over {versions} versions: Pearson's r = {r}")


def spread(values: list[float | None]) -> str:
    """Mean ± sample standard deviation over seeds, the figures a run lacks left out ("—": none)."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {sd:.2f}"


def held_out_column(runs: list[tuple[int, dict, dict]]) -> str:
    """The held-out questions across a setting's seeds: the base model, the first version after
    RATINGS ratings (the ratings it had, per seed) and the final version ("—" for runs saved
    before the bench asked them)."""
    base = [s["held_out_by_version"][0]["score"] for _, _, s in runs if s.get("held_out_by_version")]
    after = [(row, run) for _, run, s in runs if (row := s.get("held_out_after_ratings"))]
    final = [f["held_out"]["score"] for _, _, s in runs if (f := s.get("final")) and f.get("held_out")]
    if not (base or after or final):
        return "—"
    counts = ", ".join(f"{row['ratings']}{updates_before(run, row['version'])}" for row, run in after)
    return f"{spread(base)} → {spread([row['score'] for row, _ in after])} ({counts or 'never'}) → {spread(final)}"


def held_out_by_then(runs: list[tuple[int, dict, dict]], ratings: int | None = None) -> str | None:
    """The stricter reading of "after about fifteen ratings": per seed the last version read
    after at most `ratings` ratings. The summary's first version after RATINGS can come
    ten ratings later on a seed whose updates fell just short of it, and flatter it; this one
    can stand for a version read after nine. Both are quoted (`ratings`: RATINGS + 2 unless
    given; None: no run read one)."""
    ratings = RATINGS + 2 if ratings is None else ratings
    read = [(seed, row) for seed, _, s in runs if (row := held_out_by(s.get("held_out_by_version") or [], ratings))]
    if not read:
        return None
    per_seed = ", ".join(f"{row['score']:.2f} (seed {seed}, v{row['version']}@{row['ratings']})" for seed, row in read)
    return f"the last version read after at most {ratings} ratings {spread([row['score'] for _, row in read])}: {per_seed}"


def updates_before(run: dict, version: int) -> str:
    """The published updates that made `version`, with the samples of each (" in 2 updates:
    8+6"; nothing for a run saved without its steps):
    an update moves the policy about as far whatever its batch (the KL brake and target set
    its length), so the ratings a reading follows say less than how many updates they made —
    and on this bench that depends on the machine's pace, partial batches training after
    NEXTSTATE_BATCH_WAIT_S."""
    if not run.get("steps"):
        return ""
    sizes = [str(s.get("samples", "?")) for s in run["steps"] if s.get("published") and s.get("version", 0) <= version]
    return f" in {len(sizes)} update{'s' if len(sizes) != 1 else ''}: {'+'.join(sizes) or '—'}"


def _places(value: float | None, places: int = 3) -> str:
    """A figure to `places` places, or a dash where it could not be measured (e.g. every reply too short)."""
    return "—" if value is None else f"{value:.{places}f}"


def report(paths: list[str]) -> None:
    """One line per run of saved results: what BENCHMARKS.md's tables quote."""
    print("| run | mode | score, first quarter → last | updates published / held back | repeated words, last quarter "
          f"| the same over the first {LENGTH_MATCHED_WORDS} words | words per reply, last quarter "
          "| final evaluation: version, score ± s.e., repeated words ± s.e. (replies) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in paths:
        result = json.loads(Path(path).read_text())
        for run, s in zip(result["runs"], result["summary"]):
            last = run["tasks"][-max(1, len(run["tasks"]) // 4):]
            length = statistics.fmean(len(t["first_reply"].split()) for t in last)
            long_enough = sum(len(t["first_reply"].split()) >= LENGTH_MATCHED_WORDS for t in last)
            final = run.get("final")
            evaluated = "—"
            if final:
                # From the stored replies, so files saved before a figure existed report it too.
                samples = final["samples"]
                score_se = standard_error([r["score"] for r in samples])
                repetition_se = standard_error([repetition(r["first_reply"]) for r in samples])
                evaluated = (f"v{final['version']}, {_places(final['score'])} ± {_places(score_se)}, "
                             f"{_places(final['repetition'])} ± {_places(repetition_se)} ({final['replies']})")
            print(f"| {result.get('variant') or Path(path).stem} | {s['mode']} | {s['score_first_quarter']:.2f} → "
                  f"{s['score_last_quarter']:.3f} | {s['updates_published']} / {s['updates_skipped']} | "
                  f"{mean_repetition(last)} | {mean_repetition(last, LENGTH_MATCHED_WORDS)} ({long_enough} of {len(last)} replies) | {length:.1f} "
                  f"| {evaluated} |")


def figures_against_success(tasks: list[dict], steps: list[dict], prose: dict | None = None) -> list[dict]:
    """Per version (v0, the base model, included with gain and forgetting 0): what the learner
    measured on the held-out turns (learner/held_out.py) beside what the simulated user got
    from it — the mean first-reply success of the tasks that version answered — and, where the
    run read it, the version's forgetting on the bench's own held-out prose (`prose`)."""
    prose = {int(v): f for v, f in (prose or {}).items()}  # JSON keeps the versions as strings
    served: dict[int, list[float]] = {}
    for t in tasks:
        served.setdefault(t["version"], []).append(t["score"])
    figures = {0: {"gain": 0.0, "accepted": 0.0, "rejected": 0.0, "wish": 0.0, "forgetting": 0.0}}
    figures.update({s["version"]: s["figures"] for s in steps if s.get("published") and s.get("figures")})
    return [{"version": v, "gain": f.get("gain"), "accepted": f.get("accepted"), "rejected": f.get("rejected"),
             "wish": f.get("wish"), "forgetting": f.get("forgetting"), "held_out": f.get("held_out"),
             "success": round(statistics.fmean(served[v]), 3), "tasks": len(served[v]),
             "prose_forgetting": prose.get(v)}
            for v, f in sorted(figures.items()) if v in served]


def gain_correlation(rows: list[dict], figure: str = "gain", truth: str = "success") -> float | None:
    """Pearson's r between each version's held-out `figure` (gain, or its halves accepted and
    rejected) and its measured `truth` (success; or the bench's prose forgetting against the
    gate's), None under three versions or with no spread in either."""
    pairs = [(r[figure], r[truth]) for r in rows if r.get(figure) is not None and r.get(truth) is not None]
    if len(pairs) < 3 or len({g for g, _ in pairs}) < 2 or len({s for _, s in pairs}) < 2:
        return None
    return round(statistics.correlation([g for g, _ in pairs], [s for _, s in pairs]), 3)


# "A person's stated wish visible on held-out questions after about fifteen ratings."
RATINGS = 15


def held_out_after(rows: list[dict], ratings: int = RATINGS) -> dict | None:
    """The first version that began serving after at least `ratings` ratings, as read on the
    held-out questions (`rows`: held_out_by_version); None if the run never got that far."""
    return next((r for r in rows if r["ratings"] >= ratings and r["version"] > 0), None)


def held_out_by(rows: list[dict], ratings: int) -> dict | None:
    """The last version read after at most `ratings` ratings (held_out_after's stricter twin);
    None if none was read by then."""
    return next((r for r in reversed(rows) if r["version"] > 0 and r["ratings"] <= ratings), None)


def summarise(run: ModeRun) -> dict:
    scores = [t.score for t in run.tasks]
    by_version: dict[str, list[float]] = {}
    for t in run.tasks:
        bucket = "v0" if t.version == 0 else f"v{1 + 4 * ((t.version - 1) // 4)}-{4 + 4 * ((t.version - 1) // 4)}"
        by_version.setdefault(bucket, []).append(t.score)
    quarter = max(1, len(scores) // 4)
    return {
        "mode": run.mode,
        "tasks": len(scores),
        "score_first_quarter": round(statistics.fmean(scores[:quarter]), 3),
        "score_last_quarter": round(statistics.fmean(scores[-quarter:]), 3),
        "repetition_first_quarter": mean_repetition([asdict(t) for t in run.tasks[:quarter]]),
        "repetition_last_quarter": mean_repetition([asdict(t) for t in run.tasks[-quarter:]]),
        "repetition_last_quarter_length_matched": mean_repetition([asdict(t) for t in run.tasks[-quarter:]],
                                                                  LENGTH_MATCHED_WORDS),
        "updates_published": sum(1 for s in run.steps if s.get("published")),
        "updates_skipped": sum(1 for s in run.steps if not s.get("published")),
        "updates_to_0_8": updates_to_reach([asdict(t) for t in run.tasks]),
        "score_by_window": by_window(scores),
        "score_sensible_by_window": (sensible := sensible_scores([asdict(t) for t in run.tasks])) and by_window(sensible),
        "score_by_serving_version": {k: {"score": round(statistics.fmean(v), 3), "tasks": len(v)} for k, v in by_version.items()},
        "final": run.final and without_samples(run.final),
        "held_out_by_version": [{"version": v} | r for v, r in sorted(run.held_out.items())],
        "held_out_after_ratings": held_out_after([{"version": v} | r for v, r in sorted(run.held_out.items())]),
        "versions": (rows := figures_against_success([asdict(t) for t in run.tasks], run.steps, run.prose_forgetting)),
        "gain_vs_success": gain_correlation(rows),
    }


def headline(result: dict) -> str:
    parts = []
    for run, s in zip(result["runs"], result["summary"]):
        quarter = max(1, len(run["tasks"]) // 4)
        parts.append(f"{s['mode']} {s['score_first_quarter']:.2f}→{s['score_last_quarter']:.2f} "
                     f"({s['updates_published']} upd., repeated words {_places(mean_repetition(run['tasks'][:quarter]), 2)}→"
                     f"{_places(mean_repetition(run['tasks'][-quarter:]), 2)})")
        if run.get("final"):
            final = run["final"]
            parts[-1] += (f", final evaluation of v{final['version']}: {final['score']:.2f}, "
                          f"repeated words {_places(final['repetition'], 2)}"
                          + (f", surprise {final['surprise']:.2f} nats/token" if final.get("surprise") is not None else "")
                          + f" ({final['replies']} replies)")
            if final.get("held_out"):
                held = final["held_out"]
                parts[-1] += f", held-out questions {held['score']:.2f}" + (
                    f" ({held['score_sensible']:.2f} with sense)" if held.get("score_sensible") is not None else "")
        if (after := s.get("held_out_after_ratings")) and s.get("held_out_by_version"):
            parts[-1] += (f", held-out {s['held_out_by_version'][0]['score']:.2f} → {after['score']:.2f} "
                          f"after {after['ratings']} ratings (v{after['version']})")
    return "first-reply score, first → last quarter of tasks: " + ", ".join(parts)


def plot(result: dict, window: int = 16):
    plt = pyplot()
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(16, 4))

    def smooth(values: list[float]) -> tuple[range, list[float]]:
        return range(window, len(values) + 1), [statistics.fmean(values[i - window + 1: i + 1])
                                                for i in range(window - 1, len(values))]

    for run in result["runs"]:
        ax.plot(*smooth([t["score"] for t in run["tasks"]]), label=run["mode"])
        versions = sorted({t["version"] for t in run["tasks"]})
        bx.plot(versions, [statistics.fmean(t["score"] for t in run["tasks"] if t["version"] == v) for v in versions],
                "o-", markersize=3, label=run["mode"])
        if held := run.get("held_out"):  # JSON keeps the versions as strings
            rows = sorted((int(v), r["score"]) for v, r in held.items())
            bx.plot([v for v, _ in rows], [score for _, score in rows], "s--", markersize=3,
                    label=f"{run['mode']}, held-out questions")
        repeats = [r for r in (repetition(t["first_reply"]) for t in run["tasks"]) if r is not None]
        cx.plot(*smooth(repeats), label=run["mode"])
    ax.set_xlabel("fresh tasks (interactions)")
    ax.set_ylabel(f"score of the first reply (mean of last {window})")
    bx.set_xlabel("policy version serving the first reply (= updates)")
    bx.set_ylabel("mean score of the first replies it served")
    for axis in (ax, bx):
        axis.set_ylim(-0.02, 1.02)
    cx.set_xlabel("fresh tasks (interactions)")
    cx.set_ylabel(f"repeated words in the first reply (mean of last {window})")
    cx.set_ylim(bottom=0)
    for axis in (ax, bx, cx):
        axis.legend()
    settings = result["settings"]
    fig.suptitle(f"{result['model']}: \"{result['preference']['instruction']}\" ({settings['tasks']} tasks per mode, "
                 f"batch {settings['batch']}, lr {settings['lr']})", fontsize=10)
    return fig
