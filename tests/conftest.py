"""Shared fixtures: tiny checkpoints made once per session, the hub's contribution store, a
ledger process.

Tests that start real processes, servers on ports, PostgreSQL or a transformers model are
marked ``integration``; the fuzz tier (tests/test_fuzz_*.py) is marked ``fuzz``;
``pytest -m "not integration and not fuzz"`` (``make test-fast``) runs the rest.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if TYPE_CHECKING:
    from helpers import LedgerProcess

    from relay.hub._contributions import ContributionStore

# The fuzz tier (tests/test_fuzz_*.py, marker ``fuzz``): a fixed budget per target so that CI
# stays bounded and never flakes. By default each target runs FUZZ_EXAMPLES derandomized
# examples (the same inputs on every run, no example database); KVASIR_FUZZ_EXAMPLES=N (as
# ``make fuzz`` sets) runs N random examples instead and keeps failures in hypothesis's local
# database (.hypothesis/) so that a find replays until fixed.
FUZZ_EXAMPLES = 150
_long_fuzz = int(os.environ.get("KVASIR_FUZZ_EXAMPLES", "0") or 0)
settings.register_profile(
    "fuzz",
    max_examples=_long_fuzz or FUZZ_EXAMPLES,
    derandomize=not _long_fuzz,
    database=settings.default.database if _long_fuzz else None,
    deadline=None,  # a slow example is not a failure; each fuzz target bounds its own time
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    print_blob=True,
)

# A fuzz test's wall-clock bound (pytest-timeout) in CI; none for a long run. Each example
# is bounded on its own too: a fake clock and trio.fail_after, or a gRPC deadline.
FUZZ_TIMEOUT_S = 0 if _long_fuzz else 240


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("fuzz") is not None:
            item.add_marker(pytest.mark.timeout(FUZZ_TIMEOUT_S))


ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """A function arch -> checkpoint folder, each made at most once per test session."""
    from kvasir.tiny import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("models")
    made: dict[str, pathlib.Path] = {}

    def get(arch: str = "qwen3_moe") -> pathlib.Path:
        if arch not in made:
            made[arch] = make_tiny_checkpoint(base / arch, arch=arch, seed=0)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def two_worker_swarm(tiny_models, tmp_path_factory: pytest.TempPathFactory):
    """A hub and two workers holding half the experts of the tiny qwen3_moe each (no ledger),
    started once for the tests that only decode through it or read from it; ``.model`` is
    the checkpoint. A test that stops, freezes or poisons a component starts its own swarm."""
    from kvasir.swarm import LocalSwarm

    model = tiny_models("qwen3_moe")
    with LocalSwarm(tmp_path_factory.mktemp("swarm")) as sw:
        sw.start_hub()
        sw.start_worker("worker1", model, "*:0-3")
        sw.start_worker("worker2", model, "*:4-7")
        sw.wait_sessions(2, watch=["worker1", "worker2"])
        sw.model = model  # type: ignore[attr-defined]
        yield sw


@pytest.fixture
def hub_store(tmp_path: pathlib.Path) -> Iterator[ContributionStore]:
    """The hub's contribution store in a fresh SQLite file, closed after the test."""
    from relay.hub._contributions import ContributionStore

    store = ContributionStore(tmp_path / "hub-contrib.sqlite")
    yield store
    store.close()


@pytest.fixture
def ledger(tmp_path: pathlib.Path) -> Iterator[LedgerProcess]:
    """A ledger process on a fresh SQLite file, not started (set ``keys``, then ``start()``);
    stopped after the test if it still runs."""
    from helpers import LedgerProcess

    proc = LedgerProcess(tmp_path, f"sqlite:///{tmp_path / 'ledger.sqlite'}", [])
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.stop()


@pytest.fixture(autouse=True)
def _structlog_defaults():
    """A test that runs a main() in-process configures structlog globally (its level, its
    renderer): put the defaults back so the next test logs as it would alone."""
    yield
    import structlog

    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
