"""`/dashboard`: the learning report as a page that refreshes itself (admin key).

Server-rendered HTML with plain SVG charts: no build step, no script, nothing fetched from
elsewhere. A browser cannot send a bearer key on its own, so the page takes the admin key once
through a small form and keeps a session token for it (never the key:
core/stores/dashboard_sessions.py) in an HttpOnly, SameSite=Strict cookie scoped to `/dashboard`, Secure
behind TLS; a request with `Authorization: Bearer` works too. No other site may frame the page
(clickjacking). `/v1/admin/progress` serves the same figures as JSON.
"""

from __future__ import annotations

import asyncio
import html
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from nextstate.progress import describe_training, live_report
from nextstate.services import app_services
from nextstate.proxy.auth import authenticate_admin, bearer_secret
from nextstate.proxy.client_address import client_address, trusted_networks
from nextstate.core.stores.keys import ApiKey, KeyStore

router = APIRouter()

COOKIE = "nextstate_admin"
REFRESH_S = 10
WIDTH, HEIGHT, PAD = 460, 180, 34


@router.get("/v1/admin/progress")
async def progress(request: Request, _: ApiKey = Depends(authenticate_admin)) -> dict:
    """Is it learning: per version, samples and mean reward; per update, loss, KL and clip; the
    judge's calibration; explicit feedback. What `/dashboard` and `nextstate status` show."""
    return await asyncio.to_thread(live_report, app_services(request))


# Every dashboard answer: never framed by another site, never cached.
PAGE_HEADERS = {"Content-Security-Policy": "frame-ancestors 'none'", "X-Frame-Options": "DENY",
                "Cache-Control": "no-store"}


async def _admin_from_browser(request: Request) -> ApiKey | None:
    store: KeyStore = app_services(request).keys
    if secret := bearer_secret(request):
        key = await asyncio.to_thread(store.verify, secret)
    elif key_id := await app_services(request).stores.dashboard_sessions.key_id(request.cookies.get(COOKIE, "")):
        key = await asyncio.to_thread(store.get, key_id)  # revoked or forgotten: the session ends
    else:
        return None
    return key if key is not None and key.admin else None


def _page(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=PAGE_HEADERS)


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard(request: Request) -> Response:
    if await _admin_from_browser(request) is None:
        ended = "Your session has ended: sign in again." if request.cookies.get(COOKIE) else ""
        return _page(_login_page(ended), 401)
    report = await asyncio.to_thread(live_report, app_services(request))
    return _page(render_page(report))


@router.post("/dashboard/login", include_in_schema=False)
async def login(request: Request) -> Response:
    services = app_services(request)
    proxies = trusted_networks(services.settings.server.trusted_proxies)
    if not await services.stores.dashboard_sessions.may_try(client_address(request, proxies)):
        return _page(_login_page("Too many attempts: wait a minute."), 429)
    # a one-field form, parsed here rather than through python-multipart for one field
    key = parse_qs((await request.body()).decode("utf-8", "replace")).get("key", [""])[0]
    found = await asyncio.to_thread(services.keys.verify, key.strip()) if key.strip() else None
    if found is None or not found.admin:
        return _page(_login_page("That is not an admin key."), 401)
    response = RedirectResponse("/dashboard", status_code=303, headers=PAGE_HEADERS)
    secure = services.settings.server.behind_tls or request.url.scheme == "https"
    response.set_cookie(COOKIE, await services.stores.dashboard_sessions.open(found.id), httponly=True, samesite="strict",
                        path="/dashboard", secure=secure, max_age=int(services.stores.dashboard_sessions.lifetime_s))
    return response


# ---------------------------------------------------------------------------- rendering

_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#1d2433;background:#f7f8fa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:0 0 8px}
.muted{color:#66708a;font-size:13px} .grid{display:flex;flex-wrap:wrap;gap:16px;margin-top:16px}
.card{background:#fff;border:1px solid #dde1ea;border-radius:8px;padding:14px;min-width:300px}
.ok{color:#17803d} .bad{color:#b42318} table{border-collapse:collapse;font-size:13px}
td,th{padding:3px 10px 3px 0;text-align:right} th{color:#66708a;font-weight:500} td:first-child,th:first-child{text-align:left}
svg text{font-size:10px;fill:#66708a} .legend{font-size:12px;margin-top:4px}
.sw{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px;border-radius:2px}
"""

COLORS = {"reward": "#2563eb", "accepted": "#17803d", "dropped": "#d0d5dd", "loss": "#7c3aed", "kl": "#ea580c",
          "clip": "#0891b2", "swap": "#db2777", "gain": "#17803d", "forgetting": "#b42318"}


def _e(value: Any) -> str:
    return html.escape(str(value))


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _frame(title: str, body: str, legend: list[tuple[str, str]], name: str, points: int) -> str:
    keys = "".join(f'<span class="sw" style="background:{c}"></span>{_e(label)}' for label, c in legend)
    return (f'<div class="card"><h2>{_e(title)}</h2><svg class="chart" data-chart="{name}" data-points="{points}" '
            f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{_e(title)}">'
            f'{body}</svg><div class="legend">{keys}</div></div>')


def _empty(title: str, name: str, why: str) -> str:
    return (f'<div class="card"><h2>{_e(title)}</h2><svg class="chart" data-chart="{name}" data-points="0" width="{WIDTH}" '
            f'height="{HEIGHT}"><text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">{_e(why)}</text></svg></div>')


def _axes(lo: float, hi: float, labels: list[str]) -> str:
    parts = [f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - 8}" y2="{HEIGHT - PAD}" stroke="#dde1ea"/>']
    for value in (lo, (lo + hi) / 2, hi):
        y = _y(value, lo, hi)
        parts.append(f'<line x1="{PAD}" y1="{y:.1f}" x2="{WIDTH - 8}" y2="{y:.1f}" stroke="#eef0f4"/>'
                     f'<text x="{PAD - 4}" y="{y + 3:.1f}" text-anchor="end">{_num(round(value, 3))}</text>')
    step = max(1, len(labels) // 10)
    for i, label in enumerate(labels):
        if i % step == 0:
            parts.append(f'<text x="{_x(i, len(labels)):.1f}" y="{HEIGHT - PAD + 14}" text-anchor="middle">{_e(label)}</text>')
    return "".join(parts)


def _x(i: int, n: int) -> float:
    return PAD + 10 + (WIDTH - PAD - 28) * (i + 0.5) / max(n, 1)


def _y(value: float, lo: float, hi: float) -> float:
    span = (hi - lo) or 1.0
    return HEIGHT - PAD - (HEIGHT - PAD - 12) * (value - lo) / span


PALETTE = ("#2563eb", "#17803d", "#ea580c", "#7c3aed", "#db2777", "#0891b2")
MAX_SCOPES_DRAWN = len(PALETTE)
# The newest updates the dashboard tells the story of (shortened by the KL line search or the gate, or not published).
MAX_STEPS_TOLD = 15


def _color(label: str, index: int) -> str:
    return COLORS.get(label, PALETTE[index % len(PALETTE)])


def line_chart(title: str, name: str, labels: list[str], series: dict[str, list[float | None]], why_empty: str) -> str:
    values = [v for points in series.values() for v in points if v is not None]
    if not values:
        return _empty(title, name, why_empty)
    lo, hi = min(0.0, min(values)), max(0.0, max(values))
    body = _axes(lo, hi, labels)
    for index, (label, points) in enumerate(series.items()):
        color = _color(label, index)
        xy = [(_x(i, len(labels)), _y(v, lo, hi)) for i, v in enumerate(points) if v is not None]
        body += f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in xy)}"/>'
        body += "".join(f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in xy)
    return _frame(title, body, [(k, _color(k, i)) for i, k in enumerate(series)], name, len(values))


def stacked_bars(title: str, name: str, labels: list[str], stacks: dict[str, list[int]], why_empty: str) -> str:
    totals = [sum(column) for column in zip(*stacks.values())] if stacks else []
    if not totals or not any(totals):
        return _empty(title, name, why_empty)
    hi = float(max(totals))
    body = _axes(0.0, hi, labels)
    width = max(4.0, (WIDTH - PAD - 28) / len(labels) * 0.6)
    for i in range(len(labels)):
        base = 0.0
        for label, column in stacks.items():
            if column[i]:
                top, bottom = _y(base + column[i], 0.0, hi), _y(base, 0.0, hi)
                body += (f'<rect class="point" x="{_x(i, len(labels)) - width / 2:.1f}" y="{top:.1f}" width="{width:.1f}" '
                         f'height="{bottom - top:.1f}" fill="{COLORS[label]}"/>')
                base += column[i]
    return _frame(title, body, [(k, COLORS[k]) for k in stacks], name, sum(1 for t in totals if t))


def _calibration_html(judge: dict[str, Any]) -> str:
    calibration = judge.get("calibration") or {}
    state = calibration.get("state", "pending")
    css = "ok" if state == "passed" else "bad" if state == "failed" else "muted"
    rows = "".join(
        f'<tr><td>{_e(c["name"])}</td><td>{_e(c["accept"])}</td><td>{_e(c["verdict"])}</td>'
        f'<td class="{"ok" if c["passed"] else "bad"}">{"right" if c["passed"] else "wrong"}</td></tr>'
        for c in calibration.get("cases", [])
    )
    table = f"<table><tr><th>case</th><th>expected</th><th>verdict</th><th></th></tr>{rows}</table>" if rows else ""
    implicit = judge.get("implicit_feedback")
    if judge.get("fallback") == "hindsight":
        note = "next states teach as hints of their own (hindsight, no reward); ratings train too"
    else:
        note = "implicit feedback (next states) is judged" if implicit else "only explicit feedback trains"
    return (f'<div class="card"><h2>Judge</h2><div class="{css}">calibration {_e(state)}</div>'
            f'<div class="muted">{_e(calibration.get("detail", ""))}</div><div class="muted">{_e(note)}</div>{table}</div>')


def gain_charts(figures: list[dict[str, Any]]) -> list[str]:
    """One chart per scope (the most recently trained ones): each version's gain on its user's
    held-out turns and its forgetting on general text (learner/held_out.py), v0 the base at 0."""
    by_scope: dict[str, list[dict[str, Any]]] = {}
    for f in figures:
        by_scope.setdefault(f["scope"], []).append(f)
    if not by_scope:
        return [_empty("Gain for its user and forgetting, per version", "gain", "no version trained yet")]
    newest = sorted(by_scope, key=lambda sc: -max(f["version"] for f in by_scope[sc]))[:MAX_SCOPES_DRAWN]
    charts = []
    for scope in newest:
        rows = sorted(by_scope[scope], key=lambda f: f["version"])
        charts.append(line_chart(
            f"Gain for {scope} (held-out turns) and forgetting (general text)", "gain",
            ["v0"] + [f"v{f['version']}" for f in rows],
            {"gain": [0.0] + [f.get("gain") for f in rows], "forgetting": [0.0] + [f.get("forgetting") for f in rows]},
            "no figures yet"))
    return charts


def render_page(report: dict[str, Any]) -> str:
    versions = report["by_version"]
    numbers = sorted({v["policy_version"] for v in versions})
    labels = [f"v{n}" for n in numbers]
    # one reward line per scope (the most active ones), one bar per version summed over scopes
    by_scope: dict[str, dict[int, dict]] = {}
    for v in versions:
        by_scope.setdefault(v["scope"], {})[v["policy_version"]] = v
    drawn = sorted(by_scope, key=lambda sc: -sum(x["samples"] for x in by_scope[sc].values()))[:MAX_SCOPES_DRAWN]
    rewards = {f"reward ({sc})" if len(by_scope) > 1 else "reward":
               [by_scope[sc].get(n, {}).get("mean_reward") for n in numbers] for sc in drawn}

    def summed(field: str) -> list[int]:
        return [sum(v[field] for v in versions if v["policy_version"] == n) for n in numbers]

    steps = [s for s in report["steps"] if s.get("version") is not None or s.get("skipped")]
    step_labels = [f"v{s['version']}" if s.get("version") is not None else "skip" for s in steps]
    published = [s for s in steps if s.get("published")]
    charts = [
        line_chart("Mean reward of the turns each version served", "reward", labels, rewards, "no judged turns yet"),
        stacked_bars("Samples per serving version", "samples", labels,
                     {"accepted": summed("accepted"), "dropped": summed("dropped")}, "no samples yet"),
        line_chart("Each update: loss and KL to the policy that sampled", "updates", step_labels,
                   {"loss": [s.get("loss") for s in steps], "kl": [s.get("policy_kl") for s in steps]},
                   "no update yet"),
        line_chart("Each update: clip fraction", "clip", step_labels, {"clip": [s.get("clip_fraction") for s in steps]},
                   "no update yet"),
        line_chart("Hot swap into serving (seconds)", "swaps", [f"v{s['version']}" for s in published],
                   {"swap": [s.get("swap_s") for s in published]}, "no swap since the server started"),
        *gain_charts(report.get("versions") or []),
    ]
    fb, samples = report["feedback"], report["samples"]
    scopes = "".join(f"<tr><td>{_e(x['scope'])}</td><td>v{x['serving']}</td><td>{x['versions']}</td></tr>"
                     for x in report["scopes"]) or '<tr><td colspan="3">none yet: the base model serves</td></tr>'
    reasons = "".join(f"<tr><td>{_e(r)}</td><td>{n}</td></tr>" for r, n in
                      sorted(samples["dropped_reasons"].items(), key=lambda kv: -kv[1]))
    # every update that was not published, and every one whose KL line search or gate shortened it
    told = [s for s in report["steps"] if s.get("skipped") or len(s.get("kl_tries") or []) > 1
            or (s.get("step_scale") or 1) < 1]
    gate = "".join(f"<tr><td>{_e(s.get('version') if s.get('version') is not None else '-')}</td><td>{_e(s.get('scope'))}</td>"
                   f"<td>{_e(s.get('summary') or s.get('skipped'))}</td></tr>" for s in told[-MAX_STEPS_TOLD:])
    training = report.get("training")
    now = f"<div>{_e(describe_training(training))}</div>" if training else ""
    waits = "".join(f"<tr><td>{_e(w['scope'])}</td><td>{_e(w['reason'])}</td><td>{_e(w['detail'])}</td></tr>"
                    for w in report.get("waiting") or [])
    cards = [
        f'<div class="card"><h2>Training waits for</h2>{now}<table><tr><th>scope</th><th>reason</th><th>what releases it</th></tr>'
        f'{waits or "<tr><td colspan=3>nothing: every ready batch trains</td></tr>"}</table></div>',
        f'<div class="card"><h2>Serving</h2><table><tr><th>scope</th><th>serving</th><th>versions</th></tr>{scopes}</table>'
        f'<div class="muted">mode {_e(report["mode"])}, learning rate {_num(report.get("learning_rate"))}</div></div>',
        f'<div class="card"><h2>Explicit feedback</h2><div>{fb["up"]} good · {fb["down"]} bad · '
        f'{fb["with_correction"]} with a correction</div><div class="muted">POST /v1/feedback</div></div>',
        f'<div class="card"><h2>Samples</h2><div>{samples["judged"]} judged · {samples["accepted"]} accepted · '
        f'{samples["dropped"]} dropped · {samples["transitions_pending"]} waiting</div>'
        + (f'<div class="muted">and {samples["from_accepted_replies"]} from replies accepted after a correction, '
           "on the prompt they corrected</div>" if samples.get("from_accepted_replies") else "")
        + (f"<table><tr><th>dropped because</th><th></th></tr>{reasons}</table>" if reasons else "") + "</div>",
        _calibration_html(report["judge"] or {}),
        f'<div class="card"><h2>Updates shortened or held back</h2><table><tr><th>version</th><th>scope</th><th>what happened</th></tr>'
        f'{gate or "<tr><td colspan=3>none</td></tr>"}</table></div>',
    ]
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>nextstate: learning</title>'
            f'<meta http-equiv="refresh" content="{REFRESH_S}"><style>{_STYLE}</style></head><body>'
            f'<h1>nextstate: is it learning?</h1><div class="muted">refreshes every {REFRESH_S} s</div>'
            f'<div class="grid">{"".join(cards)}</div><div class="grid">{"".join(charts)}</div></body></html>')


def _login_page(note: str = "") -> str:
    note = f'<p class="bad">{_e(note)}</p>' if note else ""
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>nextstate: sign in</title><style>{_STYLE}</style>'
            f'</head><body><h1>nextstate dashboard</h1><p class="muted">An admin key (nextstate keys create --admin) '
            f'opens it for a few hours; the key itself is not kept.</p>{note}<form method="post" action="/dashboard/login">'
            f'<input type="password" name="key" placeholder="ns-..." size="40" autofocus> <button type="submit">Open</button>'
            f'</form></body></html>')
