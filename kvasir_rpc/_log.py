"""structlog set-up: JSON lines when stderr is not a terminal, readable lines when it is.
Call ``configure_logging`` from main(), never at import time."""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging", "get_logger"]


class _StderrLogger:
    """A structlog logger that prints to the ``sys.stderr`` of the moment, not the one at
    set-up (a caller that swaps stderr, or closes the one it swapped in, breaks nothing)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warn = warning = error = critical = exception = fatal = failure = err = msg


def _stderr_logger(*_args: object) -> _StderrLogger:
    return _StderrLogger()


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
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(component=component)
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)


def get_logger(name: str | None = None) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
