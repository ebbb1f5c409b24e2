"""A distributed deployment end to end, every part a process of its own on one PostgreSQL:

    two `nextstate serve` (NEXTSTATE_JUDGE_IN_PROCESS=false, NEXTSTATE_LEARN=false)
      → SGLang's real router (sglang-router) → two SGLang stand-in workers (tests/fake_sglang.py)
    two `nextstate judge`, one `nextstate learn`, a scripted judge model (tests/judge_server.py)

One stock client's conversation alternates between the two serving processes and stays one
session; its transitions are judged exactly once by two judges taking from one inbox; the
learner's version is loaded on both workers and served through both processes on both workers;
and kill -9 of a serving process mid-reply, of a worker and of the learner loses nothing and
trains nothing twice. The workers are stand-ins for speed (the tiny model on the embedded
engine behind SGLang's HTTP API); tests/test_engine_replicas.py runs real SGLang workers behind
the router.
"""

from __future__ import annotations

import concurrent.futures
import uuid

import httpx
import openai
import pytest

from nextstate.core.types import Transition
from nextstate.learner.versions import AdapterVersions
from nextstate.core.stores.keys import KeyStore
from tests.distributed_processes import FakeWorker, NextstateProcess
from tests.tiny_model import TINY_PPO_EPOCHS
from tests.judge_server import ScriptedJudge
from tests.real_engines.router_process import SGLangRouter
from tests.test_learner import wait_for

pytestmark = pytest.mark.distributed

# The user's reaction to each reply, in turn: the scripted judge scores "thanks/great" +1 and
# "no/wrong" -1, so judged turns carry rewards of both signs and a batch of two trains.
REACTIONS = ["Thanks, that is great.", "No, that is wrong.", "Great, thanks!", "No, wrong again."]
USERS = [f"user{i}" for i in range(8)]  # where a new user lands is the router's choice: several, to see both workers


def _all_or_none(starts: list) -> list:
    """Start processes at once; if one fails, stop the ones that started, and raise its error."""
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().stop()
        raise failed[0]
    return [f.result() for f in futures]


class Deployment:
    def __init__(self, tmp_path, model_dir, url: str) -> None:
        self.url, self.tmp_path = url, tmp_path
        self.judge_model = ScriptedJudge()
        self.workers, self.proxies, self.judges = [], [], []
        self.router = self.learner = None
        try:
            self._start(tmp_path, model_dir, url)
        except BaseException:  # what did start must not outlive the test as orphans
            self.stop()
            raise

    def _start(self, tmp_path, model_dir, url: str) -> None:
        self.workers = _all_or_none([lambda i=i: FakeWorker(model_dir, tmp_path, f"worker{i}") for i in range(2)])
        self.router = SGLangRouter([w.url for w in self.workers], tmp_path, health_checks=True)
        wait_for(lambda: len(self.router.listed()) == 2, timeout=30)
        self.adapters = tmp_path / "adapters"
        common = {
            "NEXTSTATE_MODEL": str(model_dir), "NEXTSTATE_SERVED_MODEL_NAME": "tiny", "NEXTSTATE_DATABASE_URL": url,
            "NEXTSTATE_ADAPTERS_DIR": str(self.adapters), "NEXTSTATE_ENGINE": "sglang",
            "NEXTSTATE_SGLANG_URL": self.router.url, "NEXTSTATE_SGLANG_ROUTER": "true",
            "NEXTSTATE_JUDGE_BASE_URL": self.judge_model.base_url, "NEXTSTATE_JUDGE_MODEL": "judge",
            "NEXTSTATE_JUDGE_CALIBRATION": "false", "NEXTSTATE_JUDGE_CONCURRENCY": "1", "NEXTSTATE_MODE": "binary",
            "NEXTSTATE_PUBLISH_GATE": "false", "NEXTSTATE_ADAPTER_SCOPE": "shared", "NEXTSTATE_SHARED_MIN_CONTRIBUTORS": "1",
            "NEXTSTATE_BATCH_SIZE": "2",
            "NEXTSTATE_MIN_BATCH_SIZE": "2", "NEXTSTATE_LR": "5e-3", "NEXTSTATE_LORA_R": "4", "NEXTSTATE_LORA_ALPHA": "8",
            "NEXTSTATE_MAX_STALENESS": "0", "NEXTSTATE_LEARNER_DEVICE": "cpu", "NEXTSTATE_PPO_EPOCHS": str(TINY_PPO_EPOCHS),
        }
        serving = {**common, "NEXTSTATE_LEARN": "false", "NEXTSTATE_JUDGE_IN_PROCESS": "false"}
        plan = [("serve", serving, "proxy0"), ("serve", serving, "proxy1"), ("judge", common, "judge0"),
                ("judge", common, "judge1"), ("learn", common, "learner")]
        started = _all_or_none([lambda p=p: NextstateProcess(p[0], p[1], tmp_path, p[2]) for p in plan])
        self.proxies, self.judges, self.learner = started[:2], started[2:4], started[4]

    def key(self, user: str) -> str:
        store = KeyStore(self.tmp_path / "unused.sqlite3", self.url)
        try:
            return store.create(user)[1]
        finally:
            store.close()

    def sql(self, query: str, *params) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.url) as conn:
            return conn.execute(query, params).fetchall()

    def current(self) -> int | None:
        return AdapterVersions(self.adapters).current("shared")

    def stop(self) -> None:
        for judge in self.judges:
            if judge.process.poll() is None:
                judge.resume()  # a paused process would not hear the stop
        for process in [*self.proxies, *self.judges, self.learner, self.router, *self.workers]:
            if process is not None:
                process.stop()
        self.judge_model.stop()


@pytest.fixture
def deployment(tmp_path, tiny_model_dir, postgres):
    started = Deployment(tmp_path, tiny_model_dir, postgres.fresh_database(f"e{uuid.uuid4().hex[:12]}"))
    yield started
    started.stop()


def client(proxy: NextstateProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0, timeout=120)


class Conversation:
    """A stock client's conversation: the whole history every time, no session header."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.messages = [{"role": "user", "content": "Name a colour."}]
        self.sessions: list[str] = []
        self.turns = 0

    def ask(self, proxy: NextstateProcess) -> httpx.Headers:
        raw = client(proxy, self.key).chat.completions.with_raw_response.create(
            model="tiny", messages=self.messages, max_tokens=6, temperature=0.0)
        self.sessions.append(raw.headers["x-session-id"])
        self.messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content or ""},
                          {"role": "user", "content": REACTIONS[self.turns % len(REACTIONS)]}]
        self.turns += 1
        return raw.headers


def transitions(d: Deployment) -> list[tuple[Transition, str, str | None]]:
    return [(Transition.model_validate_json(data), status, claimed_by)
            for data, status, claimed_by in d.sql("SELECT data, status, claimed_by FROM transitions ORDER BY id")]


def trained_sample_ids(d: Deployment) -> list[int]:
    versions = AdapterVersions(d.adapters)
    return [i for v in versions.versions("shared") for i in versions.manifest("shared", v).get("sample_ids", [])]


def test_replicas_judges_and_a_learner_of_their_own_learn_from_one_conversation_and_survive_kill_9(deployment):
    d = deployment
    alice = Conversation(d.key("alice"))

    # -- one conversation alternating between the serving processes; the judges paused, so
    #    that the inbox fills and both take from it at once when they go on
    for judge in d.judges:
        judge.pause()
    for turn in range(8):
        assert alice.ask(d.proxies[turn % 2])["x-policy-version"] == "0"
    assert len(set(alice.sessions)) == 1, "one session, whichever process took each request"
    waiting = transitions(d)
    assert [(t.turn.turn_index, status, by) for t, status, by in waiting] == [(i, "pending", None) for i in range(1, 7)]
    assert [t.next_state.messages[-1]["content"] for t, _, _ in waiting] == [REACTIONS[i % 4] for i in range(6)]
    for judge in d.judges:
        judge.resume()

    # -- each transition judged once, by one of two judges; the learner trains and publishes
    wait_for(lambda: all(status == "done" for _, status, _ in transitions(d)), timeout=60)
    judged = d.sql('SELECT session_id, turn_index, reward FROM samples WHERE "user" = %s ORDER BY turn_index', "alice")
    assert [(s, i) for s, i, _ in judged] == [(alice.sessions[0], i) for i in range(1, 7)], "one sample per turn"
    assert [r for _, _, r in judged] == [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    judges = {by for _, _, by in transitions(d)}
    assert len(judges) == 2 and all(":judge:" in by for by in judges), f"both judges took part: {judges}"
    # six samples, batches of two: three versions, the last one current
    wait_for(lambda: d.current() == 3, timeout=120)
    version = d.current()
    adapter = AdapterVersions(d.adapters).serving_name("shared", version)

    # -- the version is on both workers and served through both processes on both of them
    # (the learner writes CURRENT, then loads it on every worker; a serving process that sees
    # CURRENT first loads it on every worker itself before it serves it)
    for worker in d.workers:
        wait_for(lambda: adapter in worker.loaded_adapters(), timeout=30)
    keys = {user: d.key(user) for user in USERS}
    for proxy in d.proxies:
        wait_for(lambda: client(proxy, keys["user0"]).chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2).headers["x-policy-version"]
            == str(version), timeout=30)
    def hello(i: int) -> str:
        return client(d.proxies[i % 2], keys[USERS[i]]).chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": f"hello from {USERS[i]}"}], max_tokens=2,
        ).headers["x-policy-version"]

    # at once, as the newcomers below: one at a time, min_load's ties may put every user on one worker
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(hello, range(len(USERS)))) == [str(version)] * len(USERS)
    for worker in d.workers:
        assert adapter in worker.served(), f"{worker.name} served no request on the new version"

    # -- kill -9 of a serving process in the middle of a reply: the client tries again on the
    #    other, and the conversation goes on as the same session (the workers hold every stream
    #    after its first event: a sampled stop token cannot end the reply before the kill)
    before = alice.turns
    for worker in d.workers:
        worker.set_mode("stall")
    streaming = client(d.proxies[0], alice.key).chat.completions.create(
        model="tiny", messages=alice.messages, max_tokens=400, temperature=1.0, stream=True)
    first = next(iter(streaming))
    assert first is not None
    d.proxies[0].kill()
    with pytest.raises(Exception):
        for _ in streaming:
            pass
    for worker in d.workers:
        worker.set_mode("ok")
    alice.ask(d.proxies[1])
    assert alice.turns == before + 1 and set(alice.sessions) == {alice.sessions[0]}
    d.proxies[0].start()  # back, it goes on with the same conversation too
    alice.ask(d.proxies[0])
    assert set(alice.sessions) == {alice.sessions[0]}

    # -- kill -9 of a worker: the users on it are refused while it is down, and served on the
    #    current version once it is back, empty, on the same address
    dead = d.workers[0]
    dead.kill()
    answers = {}
    for user in USERS:
        try:
            answers[user] = client(d.proxies[1], keys[user]).chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=2).status_code
        except openai.APIStatusError as exc:
            answers[user] = exc.status_code
    assert 200 in answers.values(), "the users on the other worker are still served"
    dead.start()
    # (the learner goes on training as alice's turns are judged: a reply may come from a
    # version published since, never from one before or from the base model)
    for user in USERS:
        headers = client(d.proxies[1], keys[user]).chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "back?"}], max_tokens=2).headers
        assert int(headers["x-policy-version"]) >= version
    # the router moved the users of the dead worker: new users find the restarted one, empty at
    # its start, which serves them the published versions (loaded on it before it serves them)
    versions = AdapterVersions(d.adapters)
    published = lambda: {versions.serving_name("shared", v) for v in versions.versions("shared") if v >= version}  # noqa: E731
    def newcomer(i: int) -> int:
        return int(client(d.proxies[i % 2], d.key(f"user{i}")).chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "new here"}], max_tokens=2).headers["x-policy-version"])

    for batch in range(4):  # at once: min_load places them by the requests in flight (one at a time: a tie)
        if published() & set(dead.served()):
            break
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert all(v >= version for v in pool.map(newcomer, range(8 + 4 * batch, 12 + 4 * batch)))
    assert set(dead.served()) and set(dead.served()) <= published(), "the restarted worker serves the versions, never base"

    # -- kill -9 of the learner with samples waiting: restarted, it trains each sample once
    for _ in range(5):
        alice.ask(d.proxies[1])
    wait_for(lambda: d.sql("SELECT COUNT(*) FROM samples WHERE status IN ('ready', 'consumed')")[0][0] >= 10, timeout=60)
    d.learner.kill()
    d.learner.start()  # the adapters folder's lock went with the dead process
    # trained in batches of two: at most one ready sample can be left waiting
    wait_for(lambda: len(d.sql("SELECT id FROM samples WHERE status = 'ready'")) < 2, timeout=120)
    trained = trained_sample_ids(d)
    assert len(trained) == len(set(trained)), "no sample trained twice"
    consumed = {i for (i,) in d.sql("SELECT id FROM samples WHERE status = 'consumed'")}
    assert consumed == set(trained), "every consumed sample is in exactly the version that trained it"
    # nothing left unjudged: the judges get to every transition (on a loaded machine after the learner)
    wait_for(lambda: all(status != "pending" for _, status, _ in transitions(d)), timeout=60)
    assert len({t.turn.session_id for t, _, _ in transitions(d) if t.turn.user == "alice"}) == 1
