"""The bench's checkpoint: one MoE layer of float32 experts of random weights, by default two of
Qwen3-30B-A3B's expert shape (HIDDEN, INTER).
"""

from __future__ import annotations

import json
import pathlib

HIDDEN, INTER = 2048, 768


def make_bench_checkpoint(directory: pathlib.Path, *, experts: int = 2, inter: int = INTER,
                          hidden: int = HIDDEN, gpt_oss: bool = False) -> pathlib.Path:
    """One MoE layer of ``experts`` float32 experts of random weights, per-expert tensors, in
    ``directory`` (made if absent); returns it. By default two of Qwen3-30B-A3B's expert shape
    (38 MB). ``hidden`` is the width of a row on the wire; a small ``inter`` makes computing
    an expert cost next to nothing. ``gpt_oss``: gpt-oss's experts instead (fused tensors stored
    transposed, biases, its clamped SwiGLU over interleaved outputs). The tensors are all in
    memory once while it writes them."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, object] = {"model_type": "gpt_oss" if gpt_oss else "qwen3_moe", "num_hidden_layers": 1, "num_experts": experts,
              "hidden_size": hidden, "moe_intermediate_size": inter, "hidden_act": "silu", "dtype": "float32"}
    if gpt_oss:
        config.update(swiglu_alpha=1.702, swiglu_limit=7.0)
    (directory / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    if gpt_oss:
        p = "model.layers.0.mlp.experts"
        tensors[f"{p}.gate_up_proj"] = torch.randn(experts, hidden, 2 * inter, generator=g).mul_(0.02)
        tensors[f"{p}.gate_up_proj_bias"] = torch.randn(experts, 2 * inter, generator=g).mul_(0.02)
        tensors[f"{p}.down_proj"] = torch.randn(experts, inter, hidden, generator=g).mul_(0.02)
        tensors[f"{p}.down_proj_bias"] = torch.randn(experts, hidden, generator=g).mul_(0.02)
    for e in range(0 if gpt_oss else experts):
        p = f"model.layers.0.mlp.experts.{e}"
        tensors[f"{p}.gate_proj.weight"] = torch.randn(inter, hidden, generator=g).mul_(0.02)
        tensors[f"{p}.up_proj.weight"] = torch.randn(inter, hidden, generator=g).mul_(0.02)
        tensors[f"{p}.down_proj.weight"] = torch.randn(hidden, inter, generator=g).mul_(0.02)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
