"""Shared fixtures: tiny checkpoints made once per session, local swarms of real processes."""

from __future__ import annotations

import os
import pathlib

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """A function arch -> checkpoint folder, each made at most once per test session."""
    from kvasir_rpc.dev.tiny import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("models")
    made: dict[str, pathlib.Path] = {}

    def get(arch: str = "qwen3_moe") -> pathlib.Path:
        if arch not in made:
            made[arch] = make_tiny_checkpoint(base / arch, arch=arch, seed=0)
        return made[arch]

    return get
