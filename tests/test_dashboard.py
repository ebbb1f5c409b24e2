"""Seeing it learn: `/v1/admin/progress`, `/dashboard` (also in a real headless Chromium) and
`nextstate status`."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from tests.forked_process import nextstate_env, run_cli
from tests.test_feedback import ASK, nextstate_status, rate
from tests.test_learner import learning_server, wait_for


@pytest.fixture
def learned(server_factory):
    """A server that served, was rated, and published a version from the ratings."""
    server = learning_server(server_factory, batch_size=2, max_user_share=1.0)
    alice = server.key("alice")
    client = server.client(alice)
    for i, rating in enumerate((1, -1, 1, -1)):
        reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, seed=i)
        rate(server, alice, reply.id, rating, None if rating > 0 else "Shorter, please.")
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 2, timeout=120)
    client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4)  # served by v2
    return server


def test_progress_report_has_the_figures(learned):
    admin = learned.key("root", admin=True)
    resp = httpx.get(f"{learned.base_url}/admin/progress", headers={"Authorization": f"Bearer {admin}"})
    assert resp.status_code == 200
    report = resp.json()
    assert report["feedback"] == {"up": 2, "down": 2, "with_correction": 2}
    assert report["scopes"] == [{"scope": "shared", "serving": 2, "versions": 2}]
    # v1 trains on the first two ratings: the third and fourth replies are v0's or, if it was
    # published in between (a fast machine), v1's
    by_version = report["by_version"]
    assert [v["policy_version"] for v in by_version] in ([0], [0, 1])
    assert sum(v["samples"] for v in by_version) == 4 and sum(v["feedback_up"] for v in by_version) == 2
    # the report rounds each mean to 4 places: the rewards (+1, -1, +1, -1) sum to 0 within that
    assert sum(v["mean_reward"] * v["accepted"] for v in by_version) == pytest.approx(0.0, abs=1e-3)
    published = [s for s in report["steps"] if s["published"]]
    assert [s["version"] for s in published] == [1, 2]
    assert all(s["loss"] is not None and s["swap_s"] is not None for s in published)
    assert report["learning_rate"] == 5e-3
    # the table is by the version that answered the turns: v0's row is not "served by v0" now
    from nextstate.progress import render_text

    def table(report: dict) -> dict[str, bool]:  # version → marked as serving now, in the judged turns' table
        section = render_text(report, "here").split("judged turns, by the version that answered them:")[1].split("\n\n")[0]
        return {line.split()[1]: line.endswith("(serving now)") for line in section.splitlines() if line.startswith("shared ")}

    assert "judged turns, by the version that answered them:" in render_text(report, "here")
    assert not any(table(report).values()), "v2 serves, and answered no judged turn yet"
    answered_by_v2 = {**report, "by_version": by_version + [{**by_version[0], "policy_version": 2}]}
    assert table(answered_by_v2) == {**{f"v{v['policy_version']}": False for v in by_version}, "v2": True}
    user = learned.key("bob")
    assert httpx.get(f"{learned.base_url}/admin/progress", headers={"Authorization": f"Bearer {user}"}).status_code == 403


def test_the_dashboard_needs_an_admin_key_and_draws_its_charts(learned):
    root = learned.root
    assert httpx.get(f"{root}/dashboard").status_code == 401
    bad = httpx.post(f"{root}/dashboard/login", data={"key": learned.key("bob")})
    assert bad.status_code == 401 and "not an admin key" in bad.text
    admin = learned.key("root", admin=True)
    login = httpx.post(f"{root}/dashboard/login", data={"key": admin})
    assert login.status_code == 303
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict") and "Path=/dashboard" in cookie
    assert admin not in cookie, "the cookie holds a session token, never the key"
    page = httpx.get(f"{root}/dashboard", cookies=login.cookies)
    assert page.status_code == 200 and page.headers["cache-control"] == "no-store"
    points = dict(re.findall(r'data-chart="(\w+)" data-points="(\d+)"', page.text))
    assert int(points["reward"]) >= 1 and int(points["samples"]) >= 1 and int(points["updates"]) >= 2
    assert int(points["swaps"]) == 2
    # v0 (the base: 0 and 0), then the forgetting of v1 and v2; no turn is held out here, so no gain of theirs
    assert int(points["gain"]) == 4
    assert "2 good · 2 bad" in page.text and "calibration skipped" in page.text
    assert httpx.get(f"{root}/dashboard", headers={"Authorization": f"Bearer {admin}"}).status_code == 200


def test_nextstate_status_prints_the_same_figures(learned):
    out = nextstate_status(learned)
    assert "explicit feedback: 2 good, 2 bad (2 with a correction)" in out
    assert "shared serves v2 of 2" in out
    assert re.search(r"v1\s+shared\s+2\s+\S+\s+\S+\s+\S+\s+(\d passes over the batch, )?published as v1", out), out


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.mark.skipif(_chromium() is None, reason="needs Chromium and chromedriver (Debian: chromium chromium-driver)")
def test_the_dashboard_renders_in_a_real_browser(learned, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By

    browser, driver_path = _chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1100"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        driver.get(f"{learned.root}/dashboard")
        assert "sign in" in driver.title
        driver.find_element(By.NAME, "key").send_keys(learned.key("root", admin=True))
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait_for(lambda: "learning" in driver.title, timeout=30)
        charts = {c.get_attribute("data-chart"): c for c in driver.find_elements(By.CSS_SELECTOR, "svg.chart")}
        assert set(charts) == {"reward", "samples", "updates", "clip", "swaps", "gain"}
        for name in ("reward", "samples", "updates", "swaps", "gain"):
            drawn = charts[name].find_elements(By.CSS_SELECTOR, ".point")
            assert drawn and all(p.size["width"] > 0 and p.size["height"] > 0 for p in drawn), f"{name} chart is empty"
        shot = Path(os.environ.get("NEXTSTATE_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        driver.quit()


def test_per_user_adapters_are_reported_per_scope(server_factory):
    server = learning_server(server_factory, adapter_scope="user", batch_size=2, learn=True)
    for user, rating in (("alice", 1), ("bob", -1)):
        key = server.key(user)
        for i in range(2):
            reply = server.client(key).chat.completions.create(model="tiny", messages=ASK, max_tokens=3, seed=i)
            rate(server, key, reply.id, rating)
    wait_for(lambda: all(server.app.state.services.policies.current(u).version == 1 for u in ("alice", "bob")), timeout=120)
    admin = server.key("root", admin=True)
    report = httpx.get(f"{server.base_url}/admin/progress", headers={"Authorization": f"Bearer {admin}"}).json()
    assert {(v["scope"], v["policy_version"], v["mean_reward"]) for v in report["by_version"]} == {
        ("alice", 0, 1.0), ("bob", 0, -1.0)}
    assert sorted(x["scope"] for x in report["scopes"]) == ["alice", "bob"]
    page = httpx.get(f"{server.root}/dashboard", headers={"Authorization": f"Bearer {admin}"}).text
    assert "reward (alice)" in page and "reward (bob)" in page


def test_a_scope_that_does_not_train_says_why_everywhere(server_factory):
    """Two ratings, a batch of 16 and a partial batch of 4: nothing trains, and the progress
    report, `nextstate status`'s text and the dashboard say what it waits for."""
    from nextstate.progress import render_text

    server = learning_server(server_factory, batch_size=16, adapter_scope="user")
    alice = server.key("alice")
    client = server.client(alice)
    for i in range(2):
        reply = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, seed=i)
        rate(server, alice, reply.id, 1)
    admin = server.key("root", admin=True)
    headers = {"Authorization": f"Bearer {admin}"}

    def waiting() -> list:
        return httpx.get(f"{server.base_url}/admin/progress", headers=headers).json()["waiting"]

    wait_for(lambda: any(w["reason"] == "min_batch" for w in waiting()), timeout=30)
    (why,) = waiting()
    assert why["scope"] == "alice" and why["ready"] == 2 and "NEXTSTATE_MIN_BATCH_SIZE" in why["detail"]
    report = httpx.get(f"{server.base_url}/admin/progress", headers=headers).json()
    assert "training waits (alice, min_batch): 2 sample(s) ready" in render_text(report, "here")
    login = httpx.post(f"{server.root}/dashboard/login", data={"key": admin})
    page = httpx.get(f"{server.root}/dashboard", cookies=login.cookies)
    assert "Training waits for" in page.text and "2 sample(s) ready" in page.text


def _token(login: httpx.Response) -> str:
    return re.search(r"nextstate_admin=([^;]+)", login.headers["set-cookie"]).group(1)


def test_the_dashboard_cannot_be_framed_guessed_at_or_kept_open_with_a_stolen_cookie(server_factory):
    """The attacks: a copied cookie that was the admin key for 7 days, a page any site could
    frame, a cookie sent over plain HTTP behind the TLS proxy, unlimited sign-in guesses."""
    server = server_factory(behind_tls=True)
    root, admin = server.root, server.key("root", admin=True)
    sessions = server.app.state.services.stores.dashboard_sessions
    login = httpx.post(f"{root}/dashboard/login", data={"key": admin})
    cookie = login.headers["set-cookie"]
    assert login.status_code == 303 and "Secure" in cookie, "behind TLS, the cookie never travels in clear"
    assert int(re.search(r"Max-Age=(\d+)", cookie).group(1)) <= 8 * 3600
    session = {"nextstate_admin": _token(login)}  # as the TLS proxy would pass it on
    page = httpx.get(f"{root}/dashboard", cookies=session)
    assert page.status_code == 200
    for answer in (page, httpx.get(f"{root}/dashboard")):
        assert answer.headers["content-security-policy"] == "frame-ancestors 'none'"
        assert answer.headers["x-frame-options"] == "DENY"
    # the raw key in the cookie (what the page stored before) opens nothing
    assert httpx.get(f"{root}/dashboard", cookies={"nextstate_admin": admin}).status_code == 401
    # a session ends with its lifetime...
    sessions.lifetime_s = 0.0
    short = httpx.post(f"{root}/dashboard/login", data={"key": admin})
    assert httpx.get(f"{root}/dashboard", cookies={"nextstate_admin": _token(short)}).status_code == 401
    # ...and the moment its key is revoked
    key_id = server.app.state.services.keys.verify(admin).id
    server.app.state.services.keys.revoke(key_id)
    ended = httpx.get(f"{root}/dashboard", cookies=session)
    assert ended.status_code == 401 and "session has ended" in ended.text
    # guesses: ten a minute from one address, then 429 even for the right key
    other = server.key("root2", admin=True)
    # each from a "new" address by X-Forwarded-For: no proxy is trusted, so the header counts for nothing
    codes = [httpx.post(f"{root}/dashboard/login", data={"key": f"ns-guess-{i}"},
                        headers={"X-Forwarded-For": f"203.0.113.{i}"}).status_code for i in range(8)]
    assert codes == [401] * 8, codes  # two sign-ins were made above
    assert httpx.post(f"{root}/dashboard/login", data={"key": other}).status_code == 429


def test_a_dashboard_sign_in_holds_on_every_serving_process_of_one_database(server_factory, postgres):
    """Behind a load balancer the next page may come from another process: the session is in the
    shared database (as a hash: the table holds no cookie), and so is the sign-in throttle."""
    import uuid

    url = postgres.fresh_database(f"d{uuid.uuid4().hex[:12]}")
    a, b = (server_factory(database_url=url, judge_enabled=False) for _ in range(2))
    admin = a.key("root", admin=True)
    token = _token(httpx.post(f"{a.root}/dashboard/login", data={"key": admin}))
    assert httpx.get(f"{b.root}/dashboard", cookies={"nextstate_admin": token}).status_code == 200
    import psycopg

    with psycopg.connect(url) as conn:
        stored = [row[0] for row in conn.execute("SELECT token_hash FROM dashboard_sessions")]
    assert len(stored) == 1 and token not in stored[0]
    codes = [httpx.post(f"{(a, b)[i % 2].root}/dashboard/login", data={"key": f"ns-guess-{i}"}).status_code
             for i in range(10)]
    assert codes == [401] * 9 + [429], "ten tries a minute from one address, counted across processes"


def test_each_update_tells_its_story_in_a_sentence():
    from nextstate.progress import describe_step

    retried = {"published": True, "version": 1, "max_kl": 1.0,
               "kl_tries": [{"scale": 1.0, "kl": 1.277}, {"scale": 0.7, "kl": 0.61}]}
    assert describe_step(retried) == "first try KL 1.28 > 1, retried at 0.7 of the step: KL 0.61, published as v1"
    halved = {**retried, "kl_tries": [{"scale": 1.0, "kl": 1.2}, {"scale": 0.5, "kl": 0.3}]}
    assert "retried at half of the step: KL 0.3" in describe_step(halved)
    assert describe_step({"published": True, "version": 2, "kl_tries": [{"scale": 1.0, "kl": 0.2}]}) == "published as v2"
    gated = {"published": True, "version": 3, "kl_tries": [{"scale": 0.5, "kl": 0.2}],
             "gate": {"passed": True, "refused": [["repeats"]], "step_scale": 0.5}}
    assert describe_step(gated) == "KL 0.2 at half of the step, the gate passed it at half of that, published as v3"
    early = {"published": True, "version": 4, "epochs": 2, "epoch_kls": [0.1, 0.55], "kl_tries": [{"scale": 1.0, "kl": 0.55}]}
    assert describe_step(early) == "2 passes over the batch (KL 0.55 reached its target), published as v4"
    assert describe_step({**early, "epochs": 3}) == "3 passes over the batch, published as v4"
    lost = {"published": False, "skipped": "policy KL 3 exceeds the limit 1 even at 0.06 of the step", "returned": 4,
            "tries_before": 1, "kl_tries": [{"scale": 1.0, "kl": 9.0}, {"scale": 0.25, "kl": 3.0}], "max_kl": 1.0}
    assert describe_step(lost).endswith("not published: policy KL 3 exceeds the limit 1 even at 0.06 of the step, "
                                        "its 4 samples are ready again (try 2)")


def test_nextstate_status_says_which_update_runs_now(tmp_path):
    """`nextstate status` reads the data dir: the learner leaves TRAINING.json there while an
    update runs, and a learner that died mid-update is not taken for a running one."""
    import json as _json

    from nextstate.core.stores.samples import SampleStore
    from nextstate.learner.versions import AdapterVersions
    from nextstate.progress import progress_report, render_text

    store, versions = SampleStore(tmp_path / "samples.sqlite3"), AdapterVersions(tmp_path / "adapters")
    try:
        versions.write_training({"scope": "alice", "samples": 4, "since": 0.0, "phase": "training", "passes": [3, 8]})
        text = render_text(progress_report(store, versions, mode="combined"), "here")
        assert "training now (alice): an update on 4 samples, training (pass 3 of 8), started" in text, text
        state = _json.loads((versions.root / "TRAINING.json").read_text())
        (versions.root / "TRAINING.json").write_text(_json.dumps({**state, "pid": 2**22 + 12345}))
        assert progress_report(store, versions, mode="combined")["training"] is None, "a dead learner's file"
        versions.write_training(None)
        assert not (versions.root / "TRAINING.json").exists()
    finally:
        store.close()


def test_nextstate_status_tells_what_a_benched_judges_next_states_do(tmp_path):
    """Read from the disk (no server to ask), the judge's fallback comes from the settings."""
    from nextstate.core.stores.samples import SampleStore

    data = tmp_path / "data"
    data.mkdir()
    store = SampleStore(data / "samples.sqlite3")
    store.set_meta("judge_calibration", {"state": "failed", "detail": "the judge got 'clear thanks' wrong"})
    store.close()
    env = nextstate_env(data_dir=data)
    for fallback, said in (("hindsight", "judge: the judge failed its start-up check: next states teach as hints of their own"),
                           ("ratings", "training waits (*, judge_benched): the judge failed its start-up check: "
                                       "next states are kept, not judged")):
        done = run_cli("status", env={**env, "NEXTSTATE_JUDGE_FALLBACK": fallback})
        assert done.returncode == 0 and said in done.stdout, done.stdout + done.stderr
    # with the hindsight fallback nothing waits for the judge: next states train
    assert "judge_benched" not in run_cli("status", env=env).stdout


def test_a_running_update_shows_its_pass_progress_live_and_from_the_data_dir(server_factory):
    """Issue 43: for 19 and then 35 minutes of training, status showed only what the scope had
    waited for. Here the trainer is held after its first pass: the live report, `nextstate
    status` (from the data dir) and the dashboard say which update runs, on how much, how far."""
    import threading

    server = learning_server(server_factory, batch_size=2, adapter_scope="user")
    learner = server.app.state.services.learner
    hold = threading.Event()
    report_pass = learner._passes

    def held_pass(done: int, total: int) -> None:  # runs in the trainer's thread
        report_pass(done, total)
        hold.wait(60)

    learner._passes = held_pass
    alice = server.key("alice")
    client = server.client(alice)
    for i in range(2):
        rate(server, alice, client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, seed=i).id, 1)
    admin = server.key("root", admin=True)
    headers = {"Authorization": f"Bearer {admin}"}
    try:
        wait_for(lambda: (httpx.get(f"{server.base_url}/admin/progress", headers=headers).json().get("training")
                          or {}).get("passes"), timeout=60)
        live = httpx.get(f"{server.base_url}/admin/progress", headers=headers).json()["training"]
        assert (live["scope"], live["samples"], live["phase"], live["passes"][0]) == ("alice", 2, "training", 1)
        status = nextstate_status(server)
        assert f"training now (alice): an update on 2 samples, training (pass 1 of {live['passes'][1]})" in status, status
        login = httpx.post(f"{server.root}/dashboard/login", data={"key": admin})
        assert "training now (alice): an update on 2 samples, training (pass 1 of" in httpx.get(
            f"{server.root}/dashboard", cookies=login.cookies).text
    finally:
        hold.set()
    wait_for(lambda: server.app.state.services.policies.current("alice").version == 1, timeout=120)
    assert httpx.get(f"{server.base_url}/admin/progress", headers=headers).json()["training"] is None


def test_behind_a_trusted_proxy_the_throttle_counts_the_forwarded_client(server_factory):
    from tests.test_learner import learning_server

    server = learning_server(server_factory, learn=False, trusted_proxies=["127.0.0.0/8"])
    root = server.root
    spoofed = [httpx.post(f"{root}/dashboard/login", data={"key": "ns-guess"},
                          headers={"X-Forwarded-For": f"198.51.100.7, 203.0.113.{i}"}).status_code for i in range(12)]
    assert spoofed == [401] * 12, "twelve clients (the proxy's nearest hop), one try each"
    one = [httpx.post(f"{root}/dashboard/login", data={"key": "ns-guess"},
                      headers={"X-Forwarded-For": "203.0.113.99"}).status_code for _ in range(11)]
    assert one == [401] * 10 + [429]


def test_a_running_update_says_about_how_long_it_has_left():
    from nextstate.progress import describe_training

    training = {"scope": "alice", "samples": 4, "since": 1000.0, "phase": "training", "phase_since": 1100.0,
                "passes": [2, 8], "last_seconds": {"gate_serving": 90.0, "training": 600.0, "gate": 120.0}}
    # two passes in 60 s: six more take 180 s, then the gate as long as the last one's (120 s)
    assert describe_training(training, now=1160.0).endswith("started 160 s ago, about 5 min left")
    first = {**training, "last_seconds": {}}  # a first update: the passes' pace alone
    assert describe_training(first, now=1160.0).endswith("about 3 min left")
    before = {**first, "passes": [0, 8]}
    assert describe_training(before, now=1160.0).endswith("started 160 s ago"), "nothing to go by yet"
    gate = {**training, "phase": "gate", "phase_since": 1700.0}
    assert describe_training(gate, now=1740.0).endswith("about 80 s left")
