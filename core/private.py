"""The data dir holds every conversation: it is private to the user running nextstate.

The folder is made 0700 and everything nextstate writes in it 0600 (the process's umask is
set to 077 when it starts serving, so SQLite's databases, their journals, the records and the
adapters are all created private; files an older version left readable are fixed on start). A
data dir that cannot be written is reported at start-up in one sentence, not as a traceback
from the first database that tries.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

PRIVATE_UMASK = 0o077


class DataDirUnusable(RuntimeError):
    pass


def prepare_data_dir(path: Path) -> None:
    """Create `path` private, make what is in it private, and check that it can be written."""
    os.umask(PRIVATE_UMASK)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)
        for root, dirs, files in os.walk(path):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o700)
            for name in files:
                os.chmod(os.path.join(root, name), 0o600)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise DataDirUnusable(
            f"The data dir {path} cannot be used ({exc.strerror or exc}). nextstate keeps its keys, samples, "
            "sessions and adapters there: point NEXTSTATE_DATA_DIR at a folder this user can write."
        ) from None
