"""ExpertIndex.view: an expert's weights mapped from the checkpoint instead of read (what the
backbone's audits use) are the bytes load() reads, in every layout we read, and leave nothing
behind once dropped."""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvasir_rpc import CheckpointError, ExpertIndex
from kvasir_rpc._checkpoint import _read_spans, expert_digest


def _equal(index: ExpertIndex) -> None:
    for layer, experts in index.slices.items():
        for e in experts:
            (gu, dn), (vgu, vdn) = index.load(layer, e), index.view(layer, e)
            assert vgu.dtype == gu.dtype and vdn.dtype == dn.dtype
            assert torch.equal(vgu, gu) and torch.equal(vdn, dn), (layer, e)
            assert index.expert_digest(layer, e) == expert_digest(gu, dn)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_view_equals_load_per_expert_tensors(tiny_models, arch):
    # qwen3_moe: gate_proj and up_proj sort next to each other, so gate_up maps whole;
    # mixtral's w1 (gate), w2 (down), w3 (up) do not, so gate and up are joined.
    _equal(ExpertIndex(tiny_models(arch)))


def _rewrite(src: pathlib.Path, dst: pathlib.Path, change) -> pathlib.Path:  # type: ignore[no-untyped-def]
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file(change(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_view_equals_load_fused_and_bfloat16(tiny_models, tmp_path):
    src = tiny_models("qwen3_moe")
    info = ExpertIndex(src).info

    def fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v for k, v in tensors.items() if ".experts." not in k}
        for layer in range(info.num_layers):
            p = f"model.layers.{layer}.mlp.experts"
            gu = [torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
                  for e in range(info.num_experts)]
            out[f"{p}.gate_up_proj"] = torch.stack(gu).to(torch.bfloat16)
            out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"]
                                                 for e in range(info.num_experts)]).to(torch.bfloat16)
        return out

    index = ExpertIndex(_rewrite(src, tmp_path / "fused", fuse))
    assert index.view(0, 0)[0].dtype == torch.bfloat16
    _equal(index)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_view_is_unmapped_once_dropped_and_never_writes_the_file(tiny_models, tmp_path):
    model = _rewrite(tiny_models("qwen3_moe"), tmp_path / "m", lambda t: t)
    file = model / "model.safetensors"
    before = file.read_bytes()

    def mappings() -> int:
        return sum(str(file) in line for line in pathlib.Path("/proc/self/maps").read_text().splitlines())

    index = ExpertIndex(model)
    gate_up, down = index.view(0, 1)
    assert mappings() == 2
    row = gate_up[0]  # a view keeps its mapping alive
    del gate_up, down
    assert mappings() == 1
    row.fill_(1.0)  # copy-on-write: this process's page, not the file
    del row
    assert mappings() == 0
    assert file.read_bytes() == before


def test_a_header_that_lies_is_not_mapped(tiny_models, tmp_path):
    """A tensor whose offsets run past the end of the file is left out of what view maps
    (touching such pages would kill the process with SIGBUS); the others still map."""
    model = _rewrite(tiny_models("qwen3_moe"), tmp_path / "m", lambda t: t)
    file = model / "model.safetensors"
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = "model.layers.0.mlp.experts.0.down_proj.weight"
    a, b = header[key]["data_offsets"]
    header[key]["data_offsets"] = [a + len(raw), b + len(raw)]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    spans = _read_spans(file)
    assert key not in spans and "model.layers.0.mlp.experts.1.down_proj.weight" in spans


def test_a_file_shrunk_after_opening_is_refused_not_mapped(tiny_models, tmp_path):
    model = _rewrite(tiny_models("qwen3_moe"), tmp_path / "m", lambda t: t)
    index = ExpertIndex(model)
    index.view(0, 0)  # headers read
    file = model / "model.safetensors"
    file.write_bytes(file.read_bytes()[:4096])
    with pytest.raises(CheckpointError, match="shorter than its header"):
        index.view(0, 1)


def test_loaded_weights_start_on_a_64_byte_boundary(tiny_models, tmp_path):
    """Kept weights (a worker's, a backbone's own) must not be copied again on every call:
    expert_forward copies an operand that is not 64-byte aligned."""
    from kvasir.bench import make_bench_checkpoint

    for model in (tiny_models("qwen3_moe"), tiny_models("mixtral"), make_bench_checkpoint(tmp_path / "bench", inter=64)):
        index = ExpertIndex(model)
        for layer, experts in index.slices.items():
            for e in experts:
                for t in index.load(layer, e):
                    assert t.is_contiguous() and t.data_ptr() % 64 == 0, (model, layer, e)
