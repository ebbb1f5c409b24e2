"""The OpenClaw setup the README links (docs/agents.md) followed word for word, from a fresh OpenClaw home.

    python -m bench.openclaw_readme

Installs Node and OpenClaw as bench/openclaw_e2e does (a scratch folder; the npm registry, never
in CI), starts `nextstate serve` at its defaults on 127.0.0.1:8000 (the port the README's file
names; it must be free) with a fresh data dir, makes a key with `nextstate keys create`, and
takes the json5 block of docs/agents.md's "Use it with OpenClaw" section, key put in, as the whole
`~/.openclaw/openclaw.json` of a fresh home. Then, as a newcomer would:

1. `openclaw agent --local --message "Hello!"`: it must exit 0 with a reply that nextstate served
   as a main turn, and nothing refused.
2. The README's remedy for a workspace a first run already seeded: a second fresh home runs
   first with the provider block alone (what the README once said was enough), which seeds the
   five files and gets a 400; then the README's file and its `rm`: it must answer again.

Writes bench/results/openclaw_readme.json (prompt tokens and outcome of each run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.openclaw_e2e import install, read_records, run_turn
from bench.report import pyplot, save
from tests.background_server import wait_for_health

ROOT = Path(__file__).resolve().parents[1]
SEEDED = ("AGENTS.md", "BOOTSTRAP.md", "IDENTITY.md", "SOUL.md", "USER.md")


def readme_config(key: str | None = None, port: int = 8000) -> str:
    """The json5 block of the OpenClaw section (docs/agents.md, linked from the README), as printed
    there, with `key` for its "ns-..." and `port` for the README's 8000 when given."""
    text = (ROOT / "docs" / "agents.md").read_text()
    section = text[text.index("## Use it with OpenClaw"):]
    config = re.search(r"```json5\n(.*?)```", section, re.S).group(1)
    config = config.replace("http://127.0.0.1:8000/v1", f"http://127.0.0.1:{port}/v1")
    return config.replace('"ns-..."', json.dumps(key)) if key is not None else config


def provider_only(config: str) -> str:
    """The same file without the trimmed agent's settings: a provider block alone."""
    return re.sub(r"\n\s*//[^\n]*\n\s*//[^\n]*\n\s*skipBootstrap: true,\n\s*skills: \[\],", "",
                  config).replace('  tools: { profile: "minimal", alsoAllow: ["read", "exec"] },\n', "")


def new_records(data: Path, seen: int) -> list[dict]:
    return read_records(data)[seen:]


def run(openclaw: Path, env: dict, home: Path, config: str, data: Path, session: str) -> dict:
    (home / ".openclaw").mkdir(parents=True, exist_ok=True)
    (home / ".openclaw" / "openclaw.json").write_text(config)
    seen = len(new_records(data, 0))
    turn = run_turn(openclaw, {**env, "HOME": str(home)}, "Hello!", session, 600)
    time.sleep(1.0)  # records reach the disk within 50 ms of the reply
    records = new_records(data, seen)
    served = [r for r in records if r["kind"] == "request" and r["turn_type"] == "main"]
    refused = [r for r in records if r["kind"] == "refused"]
    return {"exit": turn["exit"], "reply": (turn["reply"] or "")[:200], "seconds": turn["seconds"],
            "prompt_tokens": served[-1]["usage"]["prompt_tokens"] if served else None,
            "refused": [r.get("code") for r in refused],
            "seeded": sorted(p.name for p in (home / ".openclaw" / "workspace").glob("*.md"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nextstate-openclaw-e2e",
                        help="where Node and OpenClaw are installed (shared with bench.openclaw_e2e)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="openclaw-readme-"))
    openclaw, env = install(args.work)
    data = work / "data"
    server_env = {**os.environ, "NEXTSTATE_DATA_DIR": str(data)}
    server = subprocess.Popen([sys.executable, "-m", "nextstate.cli", "serve"], env=server_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health("http://127.0.0.1:8000", server, timeout=300)
        made = subprocess.run([sys.executable, "-m", "nextstate.cli", "keys", "create", "--user", "newcomer"],
                              env=server_env, capture_output=True, text=True, check=True).stdout
        key = re.search(r'api_key="(ns-[^"]+)"', made).group(1)
        config = readme_config(key)
        fresh = run(openclaw, env, work / "fresh", config, data, "readme-1")
        seeded_home = work / "seeded"
        before = run(openclaw, env, seeded_home, provider_only(config), data, "readme-2")
        for name in SEEDED:  # the README's rm
            (seeded_home / ".openclaw" / "workspace" / name).unlink(missing_ok=True)
        after = run(openclaw, env, seeded_home, config, data, "readme-3")
    finally:
        server.terminate()
        server.wait(30)
    ok = (fresh["exit"] == 0 and fresh["prompt_tokens"] and not fresh["refused"]
          and after["exit"] == 0 and after["prompt_tokens"] and not after["refused"])
    result = {"benchmark": "openclaw_readme", "passed": bool(ok),
              "runs": {"fresh home": fresh, "provider block alone (a first run)": before,
                       "after the README's remedy": after}}
    print(json.dumps(result, indent=2))
    save(result)
    sys.exit(0 if ok else 1)


def plot(result: dict):
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 3))
    names = list(result["runs"])
    tokens = [result["runs"][n]["prompt_tokens"] or 0 for n in names]
    axis.barh(names, tokens, color=["#17803d" if result["runs"][n]["exit"] == 0 else "#b42318" for n in names])
    axis.axvline(8192, color="#66708a", linestyle="--")
    axis.set(xlabel="prompt tokens served (dashed: SmolLM2's context)", title="the README's OpenClaw setup")
    return figure


def headline(result: dict) -> str:
    fresh, first, after = result["runs"].values()
    return (("passed" if result["passed"] else "FAILED")
            + f": fresh home {fresh['prompt_tokens']} prompt tokens, exit {fresh['exit']}; a seeded workspace "
            + f"{first['refused'] or 'no refusal'}, after the README's rm {after['prompt_tokens']} tokens, exit {after['exit']}")


if __name__ == "__main__":
    main()
