"""structlog set-up shared by every `ndif` process: key=value lines on stderr, level from NDIF_LOG_LEVEL."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(default_level: str = "WARNING", *, json: bool | None = None) -> None:
    """Logs to stderr (stdout stays for command output); `NDIF_LOG_LEVEL`, `NDIF_LOG_JSON=1` override."""
    level_name = os.environ.get("NDIF_LOG_LEVEL", default_level).upper()
    level = logging.getLevelNamesMapping().get(level_name, logging.WARNING)
    as_json = json if json is not None else os.environ.get("NDIF_LOG_JSON", "") not in ("", "0")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
