"""Tests for kvasir.tiny.make_tiny_checkpoint (tiny random MoE checkpoints)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kvasir.tiny import ARCHES, make_tiny_checkpoint  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent

# arch -> (on-disk prefix of the decoder layers, MoE block name, (gate, up, down) names)
LAYOUT: dict[str, tuple[str, str, tuple[str, str, str]]] = {
    "qwen3_moe": ("model.layers", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_5_moe": ("model.language_model.layers", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("model.layers", "block_sparse_moe", ("w1", "w3", "w2")),
}


def test_arches() -> None:
    assert ARCHES == ("qwen3_moe", "qwen3_5_moe", "mixtral")
    assert set(LAYOUT) == set(ARCHES)


def test_unknown_arch_raises(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError) as info:
        make_tiny_checkpoint(tmp_path / "x", arch="llama")
    for arch in ARCHES:
        assert arch in str(info.value)
    assert not (tmp_path / "x").exists()


@pytest.mark.integration
def test_import_is_cheap() -> None:
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('t', {str(ROOT / 'kvasir' / 'tiny.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "heavy = [m for m in ('torch', 'transformers', 'safetensors', 'tokenizers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.integration
@pytest.mark.parametrize("arch", ARCHES)
def test_tiny_checkpoint(arch: str, tmp_path: pathlib.Path) -> None:
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = make_tiny_checkpoint(tmp_path / "a", arch=arch, seed=0)
    assert path == tmp_path / "a"
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (path / name).is_file(), name

    # --- config -------------------------------------------------------------------
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.hidden_size == 64
    assert 2 <= config.num_hidden_layers <= 4
    assert config.num_experts_per_tok == 2
    n_experts = config.num_local_experts if arch == "mixtral" else config.num_experts
    inter = config.intermediate_size if arch == "mixtral" else config.moe_intermediate_size
    assert (n_experts, inter) == (8, 32)
    if arch == "qwen3_moe":
        assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1
        assert config.norm_topk_prob is True
    if arch == "qwen3_5_moe":
        assert config.model_type == "qwen3_5_moe_text"
        assert {"linear_attention", "full_attention"} <= set(config.layer_types)

    # --- on-disk names: per-expert tensors, nothing fused ---------------------------
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    tensors = load_file(path / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert not [k for k in tensors if k.endswith(("gate_up_proj", "experts.down_proj"))]
    prefix, block, (g_name, u_name, d_name) = LAYOUT[arch]
    n_layers = config.num_hidden_layers
    for layer in range(n_layers):
        base = f"{prefix}.{layer}.{block}"
        assert tensors[f"{base}.gate.weight"].shape == (8, 64)
        for e in range(8):
            assert tensors[f"{base}.experts.{e}.{g_name}.weight"].shape == (32, 64)
            assert tensors[f"{base}.experts.{e}.{u_name}.weight"].shape == (32, 64)
            assert tensors[f"{base}.experts.{e}.{d_name}.weight"].shape == (64, 32)
        if arch == "qwen3_5_moe":
            assert tensors[f"{base}.shared_expert.gate_proj.weight"].shape == (32, 64)
            assert tensors[f"{base}.shared_expert.up_proj.weight"].shape == (32, 64)
            assert tensors[f"{base}.shared_expert.down_proj.weight"].shape == (64, 32)
            assert tensors[f"{base}.shared_expert_gate.weight"].shape == (1, 64)
    assert "lm_head.weight" in tensors

    # --- loads cleanly; fused parameters equal the per-expert tensors ---------------
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    model.eval()
    params = dict(model.named_parameters())
    for layer in range(n_layers):
        base = f"{prefix}.{layer}.{block}"
        gate = torch.stack([tensors[f"{base}.experts.{e}.{g_name}.weight"] for e in range(8)])
        up = torch.stack([tensors[f"{base}.experts.{e}.{u_name}.weight"] for e in range(8)])
        down = torch.stack([tensors[f"{base}.experts.{e}.{d_name}.weight"] for e in range(8)])
        fused = params[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        assert torch.equal(fused, torch.cat([gate, up], dim=1))  # gate rows first, then up
        assert torch.equal(params[f"model.layers.{layer}.mlp.experts.down_proj"], down)
        router = params[f"model.layers.{layer}.mlp.gate.weight"]
        assert torch.equal(router, tensors[f"{base}.gate.weight"])
    assert torch.equal(params["lm_head.weight"], tensors["lm_head.weight"])

    # --- tokenizer + greedy generation ---------------------------------------------
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) <= config.vocab_size
    enc = tok("Hello world", return_tensors="pt")
    assert tok.decode(enc.input_ids[0]) == "Hello world"
    assert tok.eos_token_id == config.eos_token_id
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    new = out[0, enc.input_ids.shape[1] :].tolist()
    assert len(new) == 8
    assert len(set(new)) >= 2, new
    assert all(0 <= t < len(tok) for t in new)
    assert isinstance(tok.decode(new), str)

    # --- determinism ------------------------------------------------------------------
    again = make_tiny_checkpoint(tmp_path / "b", arch=arch, seed=0)
    other = make_tiny_checkpoint(tmp_path / "c", arch=arch, seed=1)
    data = (path / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == data
    assert (other / "model.safetensors").read_bytes() != data
