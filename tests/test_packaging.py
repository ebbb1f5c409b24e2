"""The package works as a wheel, installed outside the source tree.

An editable checkout hides packaging mistakes (a module or a data file missing from the wheel
is still found in the source folders), so this test builds the wheel, installs it into a fresh
virtual environment in a temporary folder, and runs `nextstate serve` from there, with the
working directory outside the repository. The environment borrows nextstate's dependencies
(torch, transformers, ...) from the test's own environment through a `.pth` path entry, which
adds that folder to `sys.path` without running the `.pth` files in it, so the editable
install's import finder stays out and only the wheel can provide `nextstate`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
from openai import OpenAI

from tests.background_server import free_port, wait_for_health
from tests.forked_process import nextstate_env
from tests.judge_server import ScriptedJudge

ROOT = Path(__file__).resolve().parents[1]


def package_folders() -> dict[str, str]:
    """pyproject.toml's package-dir: each `nextstate.*` package and its folder, written once there."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


LAYER_FOLDERS = sorted({folder.split("/")[0] for name, folder in package_folders().items() if name != "nextstate"})


def copy_of_the_source(dest: Path) -> Path:
    """The checkout without what a build or a run left in it."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".mypy_cache", "results", "data"
    ))
    return dest


def borrowing_venv(venv: Path) -> Path:
    """A fresh venv that borrows this environment's packages (torch, ...) through a `.pth`
    path entry — which adds the folders to sys.path without running the `.pth` files in them,
    so the test environment's own install of nextstate stays out. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True).strip())
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "borrowed-dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(deps)))
    return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the source, so no build/ folder lands in the checkout and no file
    left over from an earlier build can slip into the wheel."""
    tmp = tmp_path_factory.mktemp("dist")
    source = copy_of_the_source(tmp / "source")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp)],
        check=True, cwd=tmp, capture_output=True,
    )
    (built,) = tmp.glob("nextstate-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_env(wheel, tmp_path_factory) -> Path:
    """A fresh venv with only the built wheel installed; returns its python."""
    python = borrowing_venv(tmp_path_factory.mktemp("wheel") / "venv")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True, capture_output=True,
    )
    return python


def run_in(python: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(python), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_wheel_holds_the_package_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert all(n.startswith(("nextstate/", "nextstate-")) for n in names), "files outside the nextstate namespace"
    sources = {n.removeprefix("nextstate/") for n in names if n.endswith((".py", ".txt"))}
    for folder in LAYER_FOLDERS:
        expected = {str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".txt")}
        assert expected <= sources, f"missing from the wheel: {sorted(expected - sources)}"
    assert not any("tiny_model" in n or "background_server" in n for n in names), "test helpers were shipped"


def test_the_wheel_ships_one_namespace_with_its_prompts(wheel_env, tmp_path):
    done = run_in(wheel_env, "import nextstate.proxy, nextstate.prompts, json; "
                  "print(json.dumps([nextstate.proxy.__file__, nextstate.prompts.__file__]))", tmp_path)
    assert done.returncode == 0, done.stderr
    venv = wheel_env.parent.parent
    for path in json.loads(done.stdout):
        assert Path(path).is_relative_to(venv), f"{path} does not come from the wheel"
    for name in LAYER_FOLDERS:
        failed = run_in(wheel_env, f"import {name}", tmp_path)
        assert failed.returncode != 0 and "ModuleNotFoundError" in failed.stderr, f"'import {name}' worked"


def test_serve_from_the_wheel_judges_with_its_bundled_prompts(wheel_env, tmp_path, tiny_model_dir):
    judge = ScriptedJudge()
    port = free_port()
    env = nextstate_env(data_dir=tmp_path / "data", model=tiny_model_dir, port=port, served_model_name="tiny",
                        judge_base_url=judge.base_url, learn="false", prm_votes=1)
    env.pop("PYTHONPATH", None)  # the wheel's own nextstate, not this checkout's
    nextstate = wheel_env.parent / "nextstate"
    created = subprocess.run([str(nextstate), "keys", "create", "--user", "wheel"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert created.returncode == 0, created.stderr
    secret = next(word for word in created.stdout.split() if word.startswith("ns-"))
    proc = subprocess.Popen([str(nextstate), "serve"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=secret, max_retries=0, timeout=60)
        ask = [{"role": "user", "content": "Say hello."}]
        reply = client.chat.completions.create(model="tiny", messages=ask, max_tokens=4)
        follow = ask + [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks!"}]
        # the session ends with this turn, so the first turn's next state goes to the judge
        client.chat.completions.create(model="tiny", messages=follow, max_tokens=4, extra_headers={"X-Session-Done": "true"})
        deadline = time.monotonic() + 60
        while not judge.calls and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
        judge.stop()
    assert judge.calls, f"the judge was never called:\n{output}"
    bundled = (ROOT / "prompts" / "prm_personal.system.txt").read_text(encoding="utf-8").strip()
    systems = [messages[0]["content"] for messages in judge.calls]
    # the judge appends its fencing note (judge/context.py) to whichever prompt it loaded
    assert any(system.startswith(bundled) for system in systems), "the judge did not get the bundled PRM prompt"


def test_mypy_follows_every_module_of_a_strict_editable_install(tmp_path):
    """docs/DEVELOPING.md's install for tools: setuptools' strict editable mode lays a link tree
    that mypy (and editors) read, and `py.typed` lets mypy type the package; the default mode's
    import hook is invisible to them."""
    source = copy_of_the_source(tmp_path / "source")
    python = borrowing_venv(tmp_path / "venv")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-build-isolation", "-q",
         "-e", str(source), "--config-settings", "editable_mode=strict"],
        check=True, capture_output=True, cwd=tmp_path,
    )
    probe = tmp_path / "probe.py"
    probe.write_text("from nextstate.proxy.turns import TurnService\nreveal_type(TurnService.prepare)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    done = subprocess.run([str(python), "-m", "mypy", "--no-incremental", str(probe)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "nextstate.proxy.turns.PreparedTurn" in done.stdout, done.stdout + done.stderr
    assert "Cannot find implementation" not in done.stdout and "missing library stubs" not in done.stdout
    # and the checkout still runs from its root in that install (nextstate/__init__.py)
    ran = subprocess.run([str(python), "-c", "import nextstate.proxy.turns as t; print(t.__file__)"], cwd=source, env=env,
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.strip().startswith(str(source)), ran.stderr
