"""structlog set-up: JSON lines when stderr is not a terminal, readable lines when it is.
Call ``configure_logging`` from main(), never at import time."""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging", "get_logger"]


def configure_logging(component: str, *, level: str = "info", json: bool | None = None) -> None:
    """Route structlog and stdlib logging to stderr. ``json=None`` picks JSON unless stderr is a tty."""
    use_json = (not sys.stderr.isatty()) if json is None else json
    lvl = getattr(logging, level.upper(), logging.INFO)
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(component=component)
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)


def get_logger(name: str | None = None) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
