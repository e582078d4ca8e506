"""structlog set-up shared by every `ndif` process: key=value lines on stderr, level from NDIF_LOG_LEVEL."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

from controlplane.core.projections.base import Projection


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


def log_new_anomalies(logger: Any, state: Projection, since_seq: int) -> int:
    """Log, once each, what the fold found after `since_seq` (the live services' half of the silent fold).

    A service notes `state.seq` before it applies a batch and calls this after; after a rebuild it
    notes the seq the rebuild reached, so the history's anomalies are not logged again. Returns how
    many it logged.
    """
    found = state.new_anomalies(since_seq)
    for a in found:
        what = "projection_anomaly" if a.event_id else "event_skipped"  # an unreadable message has no event id
        logger.warning(what, seq=a.seq, event_type=a.event_type, model_key=a.model_key, replica_id=a.replica_id,
                       message=a.message)
    return len(found)
