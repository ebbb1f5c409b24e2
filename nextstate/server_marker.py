"""Whether a server is running on a data dir: `DATA_DIR/server.json` names its pid and port.

`nextstate status` and `nextstate forget` read it: forgetting offline must not race a running
server's writes, and status says where the live figures are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nextstate.core.settings import Settings


def server_file(settings: Settings) -> Path:
    return settings.data_dir / "server.json"


def mark_running(settings: Settings, port: int) -> None:
    server_file(settings).write_text(json.dumps({"pid": os.getpid(), "port": port}))


def mark_stopped(settings: Settings) -> None:
    path = server_file(settings)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def running_server(settings: Settings) -> dict | None:
    """The pid and port of a server on this data dir that is still alive, if any."""
    try:
        info = json.loads(server_file(settings).read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info
