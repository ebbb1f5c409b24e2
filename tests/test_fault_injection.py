"""A crash anywhere between a reply and the version it teaches loses nothing and trains nothing twice.

For each point of the way — the judge's inbox, judging, storing a sample, training, writing a
version, moving CURRENT, marking samples consumed, loading the version — a real `nextstate
serve` (tests/crash_server.py) is killed there with `os._exit` while stock clients talk to it.
It is then started again on the same data, the conversations go on, and the stores must show:
every turn with a next state judged exactly once, no sample in two versions, nothing stuck in
the inbox, and learning that went on after the restart.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from openai import OpenAI

from nextstate.core.settings import Settings
from nextstate.core.stores.opener import Stores
from tests.background_server import free_port, wait_for_health
from tests.crash_server import CRASHED
from tests.forked_process import ForkedCommand, nextstate_env
from tests.judge_server import ScriptedJudge
from tests.tiny_model import TINY_PPO_EPOCHS

POINTS = ["inbox", "judging", "storing", "training", "saving", "current", "consumed", "serving"]
FEEDBACK = ["Thanks, great!", "No, that is wrong.", "Thanks!", "No, try again."]


class Server:
    def __init__(self, data: Path, model: Path, judge_url: str) -> None:
        self.port = free_port()
        self.log = data.parent / "server.log"
        self.env = {
            **nextstate_env(),
            "NEXTSTATE_DATA_DIR": str(data), "NEXTSTATE_MODEL": str(model), "NEXTSTATE_PORT": str(self.port),
            "NEXTSTATE_SERVED_MODEL_NAME": "tiny", "NEXTSTATE_JUDGE_BASE_URL": judge_url, "NEXTSTATE_PRM_VOTES": "1",
            "NEXTSTATE_MODE": "binary", "NEXTSTATE_BATCH_SIZE": "2", "NEXTSTATE_LR": "1e-3", "NEXTSTATE_LORA_R": "4",
            "NEXTSTATE_LORA_ALPHA": "8", "NEXTSTATE_MAX_KL": "1000", "NEXTSTATE_LOG_LEVEL": "warning",
            "NEXTSTATE_ADAPTER_SCOPE": "shared", "NEXTSTATE_SHARED_MIN_CONTRIBUTORS": "1",
            "NEXTSTATE_PPO_EPOCHS": str(TINY_PPO_EPOCHS),
            # as in tests/conftest.py make_settings: the judge's start-up check and the gate are
            # checked in their own tests; here they only lengthen each of the sixteen runs
            "NEXTSTATE_JUDGE_CALIBRATION": "false", "NEXTSTATE_PUBLISH_GATE": "false",
        }
        self.proc: ForkedCommand | None = None

    def start(self, *crash: str) -> None:
        """`nextstate serve`, or with POINT N, armed to die at the N-th call of POINT."""
        self.proc = (ForkedCommand("tests.crash_server", list(crash), self.env, self.log) if crash
                     else ForkedCommand("nextstate.cli", ["serve"], self.env, self.log))
        wait_for_health(f"http://127.0.0.1:{self.port}", self.proc)

    def key(self) -> str:
        """A key in the server's data dir, made here: `nextstate keys create` would cost a Python
        start with torch for each of the eight points (tests/test_keys_and_cli.py runs it)."""
        keys = Stores(Settings(data_dir=Path(self.env["NEXTSTATE_DATA_DIR"]), model=self.env["NEXTSTATE_MODEL"])).keys
        try:
            return keys.create("sam")[1]
        finally:
            keys.close()

    def converse(self, key: str, name: str, turns: int = 3) -> bool:
        """One conversation of `turns` replies (the last closes the session); False if the server died."""
        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0, timeout=30)
        messages = [{"role": "user", "content": f"Tell me about {name}."}]
        try:
            for i in range(turns):
                last = i == turns - 1
                reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                                       extra_headers={"X-Session-Done": "true"} if last else {})
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": FEEDBACK[(i + len(name)) % len(FEEDBACK)]}]
        except Exception:  # noqa: BLE001 - the crash takes the connection down
            return False
        return True

    def wait_idle(self, timeout: float = 60) -> None:
        """Until the inbox is empty and fewer ready samples than a batch remain."""
        deadline = time.monotonic() + timeout
        db = Path(self.env["NEXTSTATE_DATA_DIR"]) / "samples.sqlite3"
        while time.monotonic() < deadline:
            with sqlite3.connect(db) as conn:
                pending = conn.execute("SELECT COUNT(*) FROM transitions WHERE status = 'pending'").fetchone()[0]
                ready = conn.execute("SELECT COUNT(*) FROM samples WHERE status = 'ready'").fetchone()[0]
            if pending == 0 and ready < 2:
                time.sleep(0.5)  # a step may be publishing what it just took
                return
            time.sleep(0.2)
        raise AssertionError(f"still busy: {pending} transitions pending, {ready} samples ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def published(data: Path) -> dict[int, list[int]]:
    """version -> the sample ids it trained on."""
    root = data / "adapters" / "shared"
    if not root.is_dir():
        return {}
    return {int(v.name[1:]): json.loads((v / "manifest.json").read_text()).get("sample_ids", [])
            for v in root.iterdir() if v.is_dir() and v.name[1:].isdigit()}


@pytest.mark.parametrize("point", POINTS)
def test_a_crash_loses_nothing_and_trains_nothing_twice(point, tmp_path, tiny_model_dir):
    judge = ScriptedJudge()
    data = tmp_path / "data"
    server = Server(data, tiny_model_dir, judge.base_url)
    try:
        key = server.key()
        server.start(point, "1")
        conversations = 0
        while server.proc.poll() is None and conversations < 12:
            server.converse(key, f"topic {conversations}")
            conversations += 1
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.proc.returncode == CRASHED, f"the server did not crash at '{point}':\n{server.proc.output()}"
        before = published(data)

        server.start()
        for i in range(4):
            assert server.converse(key, f"after {i}"), server.proc.output() if server.proc.poll() is not None else ""
        server.wait_idle()
        server.stop()
    finally:
        server.stop()
        judge.stop()

    with sqlite3.connect(data / "samples.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM transitions WHERE status = 'pending'").fetchone()[0] == 0
        judged = db.execute("SELECT user, session_id, turn_index, COUNT(*) FROM samples GROUP BY 1, 2, 3").fetchall()
        statuses = dict(db.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall())
        consumed = {row[0] for row in db.execute("SELECT id FROM samples WHERE status = 'consumed'")}
    assert judged and all(count == 1 for *_, count in judged), f"a turn was judged twice: {judged}"
    after = published(data)
    trained = [i for ids in after.values() for i in ids]
    assert len(trained) == len(set(trained)), f"a sample went into two versions: {after}"
    assert consumed == set(trained), "every consumed sample is in exactly one published version"
    assert set(statuses) <= {"ready", "consumed", "dropped", "held_out"} and statuses.get("ready", 0) < 2
    assert len(after) > len(before), f"learning did not go on after the crash at '{point}'"
    versions = sorted(after)
    assert versions == list(range(1, len(versions) + 1)), "version numbers have no gaps or repeats"
    current = int((data / "adapters" / "shared" / "CURRENT").read_text())
    assert current == versions[-1]
