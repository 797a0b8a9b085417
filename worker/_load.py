"""Loading only this worker's expert slices from a checkpoint (safetensors, lazily)."""

from __future__ import annotations

import pathlib

import torch

from kvasir_rpc import ExpertIndex, SpecError, expert_digest, get_activation, parse_expert_spec, slices_digest
from worker._service import LoadedExperts

__all__ = ["load_experts", "pick_device"]


def pick_device(name: str) -> torch.device:
    """``auto`` picks CUDA, then MPS, then the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(name)


def load_experts(model: str | pathlib.Path, spec: str, device_name: str) -> LoadedExperts:
    """Read only the named slices from the checkpoint (lazily, through safetensors)."""
    index = ExpertIndex(model)
    info = index.info
    wanted = parse_expert_spec(spec, info.num_layers, info.num_experts)
    device = pick_device(device_name)
    weights = {}
    digests = {}
    for layer, experts in wanted.items():
        for e in experts:
            if not index.has(layer, e):
                continue  # dense layers of mixed models have no experts
            gate_up, down = index.load(layer, e)
            digests[(layer, e)] = expert_digest(gate_up, down)
            weights[(layer, e)] = (gate_up.to(device), down.to(device))
    if not weights:
        raise SpecError(f"SPEC {spec!r} names no expert that {model} has")
    return LoadedExperts(
        weights,
        act=get_activation(info.hidden_act),
        hidden_size=info.hidden_size,
        dtype=info.dtype,
        device=device,
        model_type=info.model_type,
        weights_digest=slices_digest(digests),
        expert_digests=digests,
    )
