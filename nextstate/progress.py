"""Is it learning? One report of the figures that say so, for the dashboard, `/v1/admin/progress`
and `nextstate status`.

Everything here is read from the data dir (the sample store and the adapter versions with
their manifests), so `nextstate status` works with the server stopped; a running server adds
what only it knows (its learner's recent steps, skipped ones and swap times included, and the
judge's live standing).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from nextstate.core.stores.samples import SampleStore
from nextstate.core.settings import LearnerSettings
from nextstate.learner.batching import waiting_in_store
from nextstate.learner.versions import AdapterVersions

if TYPE_CHECKING:  # the running server's objects; offline use (status, forget) loads no model code
    from nextstate.services import Services

STEP_FIELDS = ("loss", "policy_kl", "clip_fraction", "mean_advantage", "grad_norm", "samples", "seconds",
               "step_scale", "kl_tries", "max_kl", "epochs", "epoch_kls")


def _manifests(versions: AdapterVersions, scope: str) -> list[tuple[int, dict[str, Any]]]:
    """Each published version of `scope` with its manifest, oldest first (one unreadable is skipped)."""
    out = []
    for version in versions.versions(scope):
        try:
            out.append((version, versions.manifest(scope, version)))
        except (OSError, ValueError):
            continue
    return out


def _published_steps(scope: str, manifests: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    steps = []
    for version, manifest in manifests:
        step = manifest.get("step") or {}
        steps.append({"scope": scope, "version": version, "published": True, "skipped": None,
                      **{k: step.get(k) for k in STEP_FIELDS}})
    return steps


FIGURES = ("gain", "accepted", "rejected", "wish", "forgetting", "kl", "held_out")


def version_figures(versions: AdapterVersions, scope: str,
                    manifests: list[tuple[int, dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """Each published version of `scope` with what it gained for its user and what it forgot
    (learner/held_out.py), as its manifest keeps them (`manifests`: read already); oldest first."""
    serving = versions.current(scope) or 0
    return [{"scope": scope, "version": version, "serving": version == serving,
             **{k: (manifest.get("figures") or {}).get(k) for k in FIGURES}}
            for version, manifest in (manifests if manifests is not None else _manifests(versions, scope))]


def progress_report(
    samples: SampleStore,
    versions: AdapterVersions,
    *,
    mode: str,
    per_user: bool = False,
    learning_rate: float | None = None,
    judge: dict[str, Any] | None = None,
    live_steps: list[dict[str, Any]] | None = None,
    waiting: list[dict[str, Any]] | None = None,
    learner_settings: LearnerSettings | None = None,
    training: dict[str, Any] | None = None,
    fallback: str | None = None,
) -> dict[str, Any]:
    """The figures; `judge`, `live_steps` and `waiting` (why scopes with ready samples are not
    training, learner/batching.py) come from a running server, else from the disk (`waiting`
    from the sample store as it stands, given `learner_settings`; `fallback`: "hindsight" when a
    benched judge's next states teach as hints, as a running judge reports it)."""
    if waiting is None and learner_settings is not None:
        waiting = [w.to_dict() for w in waiting_in_store(samples, learner_settings, per_user)]
    scopes = []
    steps: list[dict[str, Any]] = []
    figures: list[dict[str, Any]] = []
    for scope in versions.scopes():
        scope_versions = versions.versions(scope)
        scopes.append({"scope": scope, "serving": versions.current(scope) or 0, "versions": len(scope_versions)})
        manifests = _manifests(versions, scope)  # read once for both
        steps += _published_steps(scope, manifests)
        figures += version_figures(versions, scope, manifests)
    if live_steps is not None:  # the live list has skipped steps (the gate's verdicts) and swap times
        published = {(s["scope"], s["version"]) for s in live_steps if s.get("published")}
        steps = [s for s in steps if (s["scope"], s["version"]) not in published]
        steps += [{**{k: s.get(k) for k in STEP_FIELDS}, "scope": s.get("scope"), "version": s.get("version"),
                   "published": s.get("published"), "skipped": s.get("skipped"), "swap_s": s.get("swap_s"),
                   "publish_to_serving_s": s.get("publish_to_serving_s"), "step": s.get("step"),
                   "gate": s.get("gate"), "returned": s.get("returned"), "tries_before": s.get("tries_before")}
                  for s in live_steps]
    for step in steps:
        step["summary"] = describe_step(step)
    stats = samples.stats()
    totals = {"judged": 0, "accepted": 0, "dropped": 0, "awaiting_outcome": 0, "from_accepted_replies": 0, "held_out": 0}
    for entry in stats["modes"].values():
        for k in totals:
            totals[k] += entry.get(k, 0)
    if judge is None:  # read from the disk: what a benched judge falls back to is the settings' word
        judge = {"implicit_feedback": None, "calibration": samples.get_meta("judge_calibration"), "fallback": fallback}
    return {
        "object": "nextstate.progress",
        "generated_at": time.time(),
        "mode": mode,
        "learning_rate": learning_rate,
        "judge": judge,
        "feedback": samples.feedback_counts(),
        "samples": {**totals, "dropped_reasons": stats["dropped_reasons"],
                    "transitions_pending": stats["transitions_pending"], "returned": samples.returned_counts()},
        "by_version": samples.by_version(per_user),
        "scopes": scopes,
        "versions": figures,
        "steps": steps,
        "waiting": _waiting(waiting, judge),
        "training": training if live_steps is not None else versions.read_training(),
    }


def describe_training(training: dict[str, Any], now: float | None = None) -> str:
    """The update running now, in a line: "training now (alice): an update on 16 samples,
    training (pass 5 of 16), started 312 s ago, about 4 min left"."""
    now = time.time() if now is None else now
    passes = training.get("passes")
    phase = training["phase"] + (f" (pass {passes[0]} of {passes[1]})" if passes and training["phase"] == "training" else "")
    left = time_left(training, now)
    return (f"training now ({training['scope']}): an update on {training['samples']} samples, {phase}, "
            f"started {max(0, now - training['since']):.0f} s ago" + (f", about {_duration(left)} left" if left else ""))


# The update's phases in order, by their names in the progress report and in phase_seconds.
_PHASES = (("scoring the serving version for the gate", "gate_serving"), ("training", "training"), ("gate", "gate"))


def time_left(training: dict[str, Any], now: float) -> float | None:
    """Seconds the running update still needs, roughly: the training passes at the pace of
    those done, and each phase still ahead as long as it took the last update. None when
    there is nothing to go by yet (a first update, before its first pass)."""
    names = [name for name, _ in _PHASES]
    if training["phase"] not in names:
        return None
    at = names.index(training["phase"])
    last = training.get("last_seconds") or {}
    in_phase = max(0.0, now - training.get("phase_since", now))
    passes = training.get("passes")
    if training["phase"] == "training" and passes and passes[0] > 0:
        left = in_phase / passes[0] * (passes[1] - passes[0])
    elif _PHASES[at][1] in last:
        left = max(0.0, last[_PHASES[at][1]] - in_phase)
    else:
        return None
    for _, key in _PHASES[at + 1:]:
        if key not in last:
            return left if left > 0 else None
        left += last[key]
    return left if left > 0 else None


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _scale(value: float) -> str:
    return "half" if value == 0.5 else f"{value:.2g}"


def describe_step(step: dict[str, Any]) -> str:
    """One update's story in a sentence: each length its KL line search tried, what the gate
    made of it, and whether it serves — "first try KL 1.28 > 1, retried at 0.63 of the step:
    KL 0.61, published"."""
    parts = []
    epochs, epoch_kls = step.get("epochs") or 1, step.get("epoch_kls") or []
    if len(epoch_kls) == epochs:  # the passes stopped at their KL target (NEXTSTATE_EPOCH_KL_SHARE)
        parts.append(f"{epochs} pass{'es' if epochs > 1 else ''} over the batch (KL {epoch_kls[-1]:.3g} reached its target)")
    elif epochs > 1:
        parts.append(f"{epochs} passes over the batch")
    tries = step.get("kl_tries") or []
    limit = step.get("max_kl")
    over = f" > {limit:g}" if limit is not None else ""
    if tries:
        first = tries[0]
        start = "" if first["scale"] >= 1 else f" at {_scale(first['scale'])} of the step"
        if len(tries) == 1:
            if start:  # a whole step's KL is the table's own column
                parts.append(f"KL {first['kl']:.3g}{start}")
        else:
            parts.append(f"first try{start} KL {first['kl']:.3g}{over}")
            parts += [f"retried at {_scale(t['scale'])} of the step: KL {t['kl']:.3g}" for t in tries[1:]]
    gate = step.get("gate") or {}
    if gate.get("refused") and gate.get("passed"):
        parts.append(f"the gate passed it at {_scale(gate['step_scale'])} of that")
    if step.get("published"):
        parts.append("published" + (f" as v{step['version']}" if step.get("version") is not None else ""))
    elif step.get("skipped"):
        parts.append(f"not published: {step['skipped']}")
        if step.get("returned"):
            tries_now = (step.get("tries_before") or 0) + 1
            parts.append(f"its {step['returned']} samples are ready again (try {tries_now})")
    return ", ".join(parts)


HINDSIGHT_NOTE = ("the judge failed its start-up check: next states teach as hints of their own (the served model "
                  "reads each reply again knowing what followed it), with no reward; ratings (POST /v1/feedback) "
                  "train too. Rewards need a capable judge: NEXTSTATE_JUDGE_BASE_URL.")


def _benched(judge: dict[str, Any] | None) -> str | None:
    """"hindsight" or "ratings" when the judge failed its check (what its next states do then)."""
    calibration = (judge or {}).get("calibration") or {}
    if calibration.get("state") != "failed":
        return None
    return "hindsight" if (judge or {}).get("fallback") == "hindsight" else "ratings"


def _waiting(waiting: list[dict[str, Any]] | None, judge: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """What training waits for while it holds: each scope's reason, and a benched judge whose
    next states are kept, not judged. (A benched judge with the hindsight fallback holds
    nothing back, so it is no wait: the judge line says what it does.) None when no server is
    running to say."""
    if waiting is None:
        return None
    out = list(waiting)
    if _benched(judge) == "ratings":
        out.append({"scope": "*", "reason": "judge_benched", "ready": None,
                    "detail": "the judge failed its start-up check: next states are kept, not judged; explicit "
                              "ratings (POST /v1/feedback) train. A capable judge: NEXTSTATE_JUDGE_BASE_URL."})
    return out


def live_report(services: Services) -> dict[str, Any]:
    """The report of a running server."""
    judge, learner = services.judge, services.learner
    report = judge.report()
    return progress_report(
        services.samples,
        AdapterVersions(services.settings.adapters_dir),
        mode=judge.settings.mode,
        per_user=services.settings.learner.adapter_scope == "user",
        learning_rate=learner.trainer.lr if learner is not None and learner.trainer is not None else None,
        judge={key: report[key] for key in ("implicit_feedback", "calibration", "feedback_applied", "fallback")},
        live_steps=list(learner.steps) if learner is not None else [],
        waiting=[w.to_dict() for w in learner.waiting.values()] if learner is not None else [],
        training=dict(learner.training) if learner is not None and learner.training else None,
    )


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def render_text(report: dict[str, Any], where: str) -> str:
    """The report as `nextstate status` prints it."""
    lines = [f"nextstate status: {where}", f"mode {report['mode']}"
             + (f", learning rate {_fmt(report['learning_rate'])}" if report.get("learning_rate") else "")]
    calibration = (report.get("judge") or {}).get("calibration")
    if calibration:
        lines.append(f"judge: calibration {calibration['state']}: {calibration['detail']}")
    else:
        lines.append("judge: not checked yet")
    if _benched(report.get("judge")) == "hindsight":
        lines.append(f"judge: {HINDSIGHT_NOTE}")
    fb = report["feedback"]
    lines.append(f"explicit feedback: {fb['up']} good, {fb['down']} bad ({fb['with_correction']} with a correction)")
    s = report["samples"]
    reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(s["dropped_reasons"].items(), key=lambda kv: -kv[1]))
    built = s.get("from_accepted_replies", 0)
    lines.append(f"samples: {s['judged']} judged, {s['accepted']} accepted, {s['dropped']} dropped"
                 + (f" ({reasons})" if reasons else "")
                 + (f", {built} more from replies accepted after a correction" if built else "")
                 + (f", {s['held_out']} of them held out (never trained: each version is scored on them)"
                    if s.get("held_out") else "")
                 + f"; {s['transitions_pending']} waiting for the judge")
    if report["scopes"]:
        lines.append("adapters: " + ", ".join(f"{x['scope']} serves v{x['serving']} of {x['versions']}" for x in report["scopes"]))
    else:
        lines.append("adapters: none yet (the base model serves)")
    if training := report.get("training"):
        lines.append(describe_training(training))
    if report.get("waiting"):
        for w in report["waiting"]:
            lines.append(f"training waits ({w['scope']}, {w['reason']}): {w['detail']}")
    elif report.get("waiting") is None:
        lines.append("training: what it waits for is not known here")
    for reason, n in sorted((s.get("returned") or {}).items(), key=lambda kv: -kv[1]):
        lines.append(f"{n} sample(s) ready again after an update was not published: {reason}")
    if report["by_version"]:
        serving = {x["scope"]: x["serving"] for x in report["scopes"]}
        lines.append("")
        lines.append("judged turns, by the version that answered them:")
        lines.append(f"{'scope':<10} {'version':>9}  {'samples':>7}  {'accepted':>8}  {'mean reward':>11}  {'rated +/-':>9}")
        for v in report["by_version"]:
            now = "  (serving now)" if serving.get(v["scope"], 0) == v["policy_version"] else ""
            lines.append(f"{str(v['scope'])[:10]:<10} {'v' + str(v['policy_version']):>9}  {v['samples']:>7}  {v['accepted']:>8}  "
                         f"{_fmt(v['mean_reward']):>11}  {str(v['feedback_up']) + '/' + str(v['feedback_down']):>9}{now}")
    if any(v.get("gain") is not None or v.get("forgetting") is not None for v in report.get("versions", [])):
        lines.append("")
        lines.append("what each version gained for its user (held-out turns) and what it forgot (general text):")
        lines.append(f"{'scope':<10} {'version':>9}  {'gain':>8}  {'accepted':>8}  {'rejected':>8}  {'wish':>6}  {'forgetting':>10}  "
                     f"{'KL':>7}  {'held out':>8}")
        for v in report["versions"][-30:]:
            now = "  (serving now)" if v.get("serving") else ""
            forgetting = f"{v['forgetting']:+.1%}" if v.get("forgetting") is not None else "-"
            gain, accepted, rejected = (f"{v[k]:+.3f}" if v.get(k) is not None else "-" for k in ("gain", "accepted", "rejected"))
            wish = f"{v['wish']:.2f}" if v.get("wish") is not None else "-"
            lines.append(f"{str(v['scope'])[:10]:<10} {'v' + str(v['version']):>9}  {gain:>8}  {accepted:>8}  {rejected:>8}  {wish:>6}  {forgetting:>10}  "
                         f"{_fmt(v.get('kl')):>7}  {_fmt(v.get('held_out')):>8}{now}")
        lines.append("gain: nats per token the version moved the held-out replies the way their reactions point, from "
                     "where the version that wrote them had them; accepted, rejected: its two halves, how much likelier "
                     "the replies you accepted became and how much less likely those you rejected (a version can gain "
                     "by the second alone without your wish showing); wish: how far the version goes untold the way your "
                     "hints and corrections move the base model told (0: not at all, 1: as far); forgetting: its "
                     "perplexity on plain text over the base model's")
    if report["steps"]:
        lines.append("")
        lines.append(f"{'update':>8}  {'scope':<10} {'samples':>7}  {'loss':>8}  {'KL':>8}  {'clip':>6}  outcome")
        for st in report["steps"][-15:]:
            outcome = st.get("summary") or ("published" if st.get("published") else f"skipped: {st.get('skipped')}")
            lines.append(f"{'v' + _fmt(st.get('version')):>8}  {str(st.get('scope'))[:10]:<10} {_fmt(st.get('samples')):>7}  "
                         f"{_fmt(st.get('loss')):>8}  {_fmt(st.get('policy_kl')):>8}  {_fmt(st.get('clip_fraction'), 2):>6}  {outcome}")
    return "\n".join(lines)
