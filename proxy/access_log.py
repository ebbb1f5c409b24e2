"""Access logs without query strings: a key sent as `?api_key=` must not end up in a log file.

uvicorn's access log line carries the full path, query included; this filter cuts the query
off before the line is written. Installed once on the `uvicorn.access` logger by the app.
"""

from __future__ import annotations

import logging


class StripQueryStrings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?[query removed]", *args[3:])
        return True


def install() -> None:
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, StripQueryStrings) for f in logger.filters):
        logger.addFilter(StripQueryStrings())
