"""CPU time of processes, for the benchmark's cost per byte by hop.

CPU time (user + system, every thread of the process, grpcio's C-core threads included) is
far less sensitive to what else runs on a shared machine than wall time: a process that
waits for a core does not accrue it. ``cpu_seconds(pid)`` reads it from Linux's
``/proc/PID/stat``; :class:`CpuMeter` snapshots a set of named processes around a stretch of
work and reports what each spent in it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import resource
import time
from collections.abc import Mapping

__all__ = ["CpuMeter", "ProcessGoneError", "cpu_seconds", "minor_faults", "ns_per_byte"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ProcessGoneError(RuntimeError):
    """The process to read has ended (or never existed); the message names its pid."""


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) that process ``pid`` has used so far; the
    current process when ``pid`` is None (``time.process_time()``, finer than ticks). Raises
    ProcessGoneError when there is no such process or it is a zombie (ended, not yet reaped),
    and OSError where /proc cannot be read (not Linux)."""
    if pid is None or pid == os.getpid():
        return time.process_time()
    fields = _stat(pid)
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / _TICKS


def minor_faults(pid: int | None = None) -> int:
    """Minor page faults (the kernel handing the process a page, no I/O) that process ``pid``
    has taken so far, all threads; the current process when None. Raises as ``cpu_seconds``."""
    if pid is None or pid == os.getpid():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    return int(_stat(pid)[7])  # field 10 of proc(5)


def _stat(pid: int) -> list[str]:
    """Fields 3 on of /proc/PID/stat (index 0 is the state); ProcessGoneError for a process that
    is gone or a zombie."""
    path = pathlib.Path(f"/proc/{pid}/stat")
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGoneError(f"process {pid} is gone: no {path}") from None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        raise ProcessGoneError(f"process {pid} has ended (state {fields[0]}): its counters are no longer kept")
    return fields


@dataclasses.dataclass(frozen=True)
class CpuReading:
    """What a CpuMeter measured: CPU seconds per name over ``wall_s`` seconds."""

    cpu_s: dict[str, float]
    wall_s: float


class CpuMeter:
    """CPU time of named processes over a ``with`` block::

        with CpuMeter({"hub": hub_pid, "client": None}) as meter:
            ...  # the work
        meter.reading.cpu_s["hub"]

    A pid of None is this process. Every process is read at entry and at exit; one that
    ended in between raises ProcessGoneError at exit (its CPU time would be lost)."""

    def __init__(self, pids: Mapping[str, int | None]) -> None:
        self.pids = dict(pids)
        self._start: dict[str, float] = {}
        self._t0 = 0.0
        self._reading: CpuReading | None = None

    def __enter__(self) -> CpuMeter:
        self._start = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            return
        wall = time.perf_counter() - self._t0
        self._reading = CpuReading({name: cpu_seconds(pid) - self._start[name] for name, pid in self.pids.items()},
                                   wall)

    @property
    def reading(self) -> CpuReading:
        if self._reading is None:
            raise RuntimeError("CpuMeter.reading is known once its with block has ended")
        return self._reading


def ns_per_byte(cpu_s: float, nbytes: int) -> float | None:
    """CPU nanoseconds per byte, rounded to 3 places; None without bytes."""
    return round(cpu_s * 1e9 / nbytes, 3) if nbytes > 0 else None
