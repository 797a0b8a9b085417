"""Loading only this worker's expert slices from a checkpoint (safetensors, lazily)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import torch

from kvasir_rpc import ExpertIndex, QuantizedWeights, SpecError, expert_digest, parse_expert_spec, slices_digest
from worker._service import DEFAULT_DEQUANTIZED_CACHE_BYTES, LoadedExperts
from worker._serving import LoadProgress  # re-exported: here before it was shared

__all__ = ["LoadProgress", "load_experts", "pick_device"]


def pick_device(name: str) -> torch.device:
    """``auto`` picks CUDA, then MPS, then the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(name)


def load_experts(model: str | pathlib.Path | ExpertIndex, spec: str, device_name: str, *,
                 progress: Callable[[LoadProgress], None] | None = None,
                 dequantized_cache_bytes: int = DEFAULT_DEQUANTIZED_CACHE_BYTES) -> LoadedExperts:
    """Read only the named slices from the checkpoint (lazily, through safetensors).

    ``model`` is a checkpoint folder or an ``ExpertIndex`` already opened on one (so a caller
    can check the folder before anything slow). ``progress`` is called once before the first
    read and after each expert, from this thread; it should be cheap. Raises CheckpointError
    (not a checkpoint, missing tensors) and SpecError (``spec`` does not parse or names
    nothing the checkpoint has)."""
    index = model if isinstance(model, ExpertIndex) else ExpertIndex(model)
    info = index.info
    wanted = parse_expert_spec(spec, info.num_layers, info.num_experts)
    device = pick_device(device_name)
    todo = [(layer, e) for layer, experts in wanted.items() for e in experts if index.has(layer, e)]
    # gate, up and down: [I, H] each, in the checkpoint's dtype
    per_expert = 3 * info.intermediate_size * info.hidden_size * info.dtype.itemsize
    done_bytes = 0
    if progress is not None:
        progress(LoadProgress(0, len(todo), 0, per_expert * len(todo)))
    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor] | QuantizedWeights] = {}
    biases = {}
    digests = {}
    for i, (layer, e) in enumerate(todo):
        bias = index.biases(layer, e)
        if index.quantized:
            # Kept as the checkpoint stores it (FP8 and scales: about half the bfloat16 bytes;
            # MXFP4: about a quarter), dequantized for each call; digested as the weights it
            # computes with.
            quantized = index.load_quantized(layer, e)
            gate_up, down = quantized.dequantize()
            weights[(layer, e)] = quantized.to(device)
            held = quantized.nbytes
        else:
            gate_up, down = index.load(layer, e)
            weights[(layer, e)] = (gate_up.to(device), down.to(device))
            held = gate_up.nbytes + down.nbytes
        digests[(layer, e)] = expert_digest(gate_up, down, *(bias or ()))
        if bias is not None:
            biases[(layer, e)] = (bias[0].to(device), bias[1].to(device))
        done_bytes += held
        if progress is not None:
            progress(LoadProgress(i + 1, len(todo), done_bytes, max(done_bytes, per_expert * len(todo))))
    if not weights:
        raise SpecError(f"SPEC {spec!r} names no expert that {index.model_dir} has")
    return LoadedExperts(
        weights,
        function=index.function,
        biases=biases,
        dequantized_cache_bytes=dequantized_cache_bytes,
        hidden_size=info.hidden_size,
        dtype=info.dtype,
        device=device,
        model_type=info.model_type,
        weights_digest=slices_digest(digests),
        expert_digests=digests,
    )
