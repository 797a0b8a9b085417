"""Checks of ``--assist`` that read only config.json: they run before torch loads, so a
model or draft model that cannot be used so fails in a second."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

__all__ = ["config_cache_problem", "config_vocab_size"]


def _text_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    text = cfg.get("text_config", cfg)
    return text if isinstance(text, dict) else {}


def config_cache_problem(model_dir: str | os.PathLike[str]) -> str:
    """Why the config.json of ``model_dir`` says its cache cannot be cut back (layers that
    are not plain attention in ``layer_types``), or ""."""
    kinds = _text_config(model_dir).get("layer_types") or []
    odd = sorted({k for k in kinds if isinstance(k, str) and k not in ("full_attention", "attention")})
    if odd:
        return f"its cache holds {', '.join(odd)} layers, which cannot be cut back to the accepted tokens"
    return ""


def config_vocab_size(model_dir: str | os.PathLike[str]) -> int | None:
    """``vocab_size`` from a checkpoint folder's config.json (its text config's), or None."""
    size = _text_config(model_dir).get("vocab_size")
    return size if isinstance(size, int) else None
