"""Quantized checkpoints as they ship (issue 29): block FP8 (DeepSeek-V3/R1's and Qwen3's
releases) and MXFP4 (gpt-oss's). The dequantization is transformers' own, bit for bit; a worker's
index reads the release layout and keeps an expert in its quantized bytes (FP8: about half its
bfloat16 size; MXFP4: about a quarter), dequantized per call."""

from __future__ import annotations

import json

import pytest
import torch

from kvasir_rpc import CheckpointError, ExpertIndex, dequantize_block_fp8, quantize_block_fp8


def _transformers_dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)


@pytest.mark.parametrize("shape,block", [((256, 384), 128), ((96, 64), 16), ((32, 64), 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_dequantizing_is_transformers_own_formula_bit_for_bit(shape, block, dtype):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05
    q, s = quantize_block_fp8(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (-(-shape[0] // block), -(-shape[1] // block))
    ours = dequantize_block_fp8(q, s, dtype)
    assert ours.dtype == dtype and torch.equal(ours, _transformers_dequantize(q, s, dtype))
    # Quantized at 3 bits of mantissa, a block's values are within 1/16 of their size.
    assert float((ours.float() - w).abs().max()) <= float(w.abs().max()) / 15


def test_a_grid_that_does_not_divide_the_weight_is_refused_as_transformers_refuses_it():
    with pytest.raises(ValueError, match="not divisible"):
        dequantize_block_fp8(torch.zeros(30, 64, dtype=torch.float8_e4m3fn), torch.ones(4, 4), torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    from kvasir.families import make_family_checkpoint

    return make_family_checkpoint(tmp_path_factory.mktemp("fp8") / "qwen3_moe", "qwen3_moe", dtype="bfloat16",
                                  shard="100KB", quant="fp8", block=16)


def test_the_release_layout(fp8_model):
    config = json.loads((fp8_model / "config.json").read_text())
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [16, 16]}
    keys = json.loads((fp8_model / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv" in keys
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in keys
    assert not any(k.startswith(("model.embed_tokens", "lm_head")) and k.endswith("_scale_inv") for k in keys)
    assert "model.layers.0.mlp.gate.weight_scale_inv" not in keys  # the router stays in bfloat16


def test_a_worker_keeps_an_expert_in_its_fp8_bytes_and_computes_what_load_gives(fp8_model):
    index = ExpertIndex(fp8_model)
    assert index.quantized and index.info.dtype == torch.bfloat16
    held = index.load_quantized(1, 5)
    gate_up, down = index.load(1, 5)
    assert gate_up.dtype == down.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(held.dequantize(), (gate_up, down)))
    # The view (audits) and the digest read the same weights.
    assert all(torch.equal(a, b) for a, b in zip(index.view(1, 5), (gate_up, down)))
    bf16_bytes = gate_up.nbytes + down.nbytes
    assert held.nbytes < 0.6 * bf16_bytes  # 16 x 16 blocks: 4 bytes of scale per 256 weights


def test_a_worker_loads_fp8_experts_held_as_fp8(fp8_model):
    from kvasir_rpc import QuantizedExpert
    from worker._load import load_experts

    experts = load_experts(fp8_model, "0:0-3", "cpu")
    assert all(isinstance(w, QuantizedExpert) for w in experts.weights.values())
    held = sum(w.nbytes for w in experts.weights.values())  # type: ignore[union-attr]
    index = ExpertIndex(fp8_model)
    bf16 = sum(t.nbytes for e in range(4) for t in index.load(0, e))
    assert held < 0.6 * bf16
    # Digested as the weights it computes with, as the backbone digests its own.
    from kvasir_rpc import expert_digest

    assert experts.expert_digests[(0, 2)] == expert_digest(*index.load(0, 2)) == index.expert_digest(0, 2)


def test_scales_on_some_experts_only_are_refused(fp8_model, tmp_path):
    key = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    with pytest.raises(CheckpointError, match="some do not"):
        ExpertIndex(_with_tensors(fp8_model, tmp_path, key, lambda t: t.pop(key)))


def _with_tensors(model, tmp_path, beside: str, change):  # type: ignore[no-untyped-def]
    """A copy of ``model`` whose shard holding ``beside`` has its tensors changed by
    ``change(tensors)`` (a dict, edited in place), the index following what it holds."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = broken / index["weight_map"][beside]
    tensors = load_file(str(shard))
    before = set(tensors)
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    for key in before - set(tensors):
        del index["weight_map"][key]
    index["weight_map"].update({key: shard.name for key in set(tensors) - before})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    return broken


def test_mxfp4_dequantizing_is_transformers_own_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kvasir_rpc import dequantize_mxfp4, quantize_mxfp4

    w = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(2)) * 0.05  # [E, in, out]
    blocks, scales = (torch.stack(t) for t in zip(*(quantize_mxfp4(w[e]) for e in range(3))))
    assert blocks.shape == (3, 96, 2, 16) and blocks.dtype == scales.dtype == torch.uint8
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, out]
    for e in range(3):
        ours = dequantize_mxfp4(blocks[e], scales[e], torch.bfloat16)
        assert torch.equal(ours, theirs[e])
        # Four bits: within a quarter of each block's largest magnitude (no value clipped).
        err = (ours.float() - w[e]).abs().transpose(0, 1).reshape(96, 2, 32).amax(-1)
        top = w[e].abs().transpose(0, 1).reshape(96, 2, 32).amax(-1)
        assert bool((err <= top / 4 + 1e-12).all())


def test_mxfp4_every_byte_and_exponent_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kvasir_rpc import dequantize_mxfp4

    # Random bytes (every float4 pair) under every exponent byte, 0 (2^-127) to 255 (2^128).
    blocks = torch.randint(0, 256, (1, 256, 2, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 256, 1).repeat(1, 1, 2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ours = dequantize_mxfp4(blocks[0], scales[0], dtype)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)[0]
        assert torch.equal(ours.isnan(), theirs.isnan()), dtype
        assert torch.equal(torch.nan_to_num(ours), torch.nan_to_num(theirs)), dtype  # overflow, subnormals too


def test_an_mxfp4_worker_holds_about_a_quarter_of_the_bfloat16_bytes(tmp_path):
    from kvasir.families import make_family_checkpoint
    from kvasir_rpc import Mxfp4Expert

    model = make_family_checkpoint(tmp_path / "gpt_oss", "gpt_oss", dtype="bfloat16", quant="mxfp4")
    config = json.loads((model / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    index = ExpertIndex(model)
    assert index.quant == "mxfp4" and index.function.transposed and index.function.bias
    held = index.load_quantized(0, 2)
    assert isinstance(held, Mxfp4Expert)
    gate_up, down = index.load(0, 2)
    assert gate_up.shape == (64, 192) and down.shape == (96, 64)  # [H, 2I], [I, H]: gpt-oss's orientation
    assert all(torch.equal(a, b) for a, b in zip(held.dequantize(), (gate_up, down)))
    assert held.nbytes < 0.35 * (gate_up.nbytes + down.nbytes)


def test_the_dequantized_cache_keeps_the_most_recently_used_within_its_bytes(fp8_model):
    from worker._load import load_experts

    index = ExpertIndex(fp8_model)
    one = sum(t.nbytes for t in index.load(0, 0))  # every expert has the same shape
    experts = load_experts(fp8_model, "0:0-3", "cpu", dequantized_cache_bytes=2 * one)
    for e in (0, 1, 0, 2):  # 1 is the least recently used when 2 comes in
        got = experts.matrices(0, e)
        assert all(torch.equal(a, b) for a, b in zip(got, index.load(0, e)))
    assert experts.dequantized_bytes == 2 * one
    assert set(experts._dequantized) == {(0, 0), (0, 2)}
    assert experts.matrices(0, 2) is experts.matrices(0, 2)  # served from the cache
    none = load_experts(fp8_model, "0:0-1", "cpu", dequantized_cache_bytes=0)
    none.matrices(0, 1)
    assert none.dequantized_bytes == 0


# --- compressed-tensors (llm-compressor's releases) ---------------------------------------------


@pytest.fixture(scope="module", params=["ct-fp8", "ct-int4"])
def ct_model(request, tmp_path_factory):
    from kvasir.families import make_family_checkpoint

    return make_family_checkpoint(tmp_path_factory.mktemp(request.param) / "qwen3_moe", "qwen3_moe",
                                  dtype="bfloat16", shard="100KB", quant=request.param)


def test_the_compressed_tensors_layouts(ct_model):
    config = json.loads((ct_model / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["quantization_status"] == "compressed"
    keys = json.loads((ct_model / "model.safetensors.index.json").read_text())["weight_map"]
    expert = "model.layers.0.mlp.experts.3.gate_proj."
    if config["format"] == "float-quantized":  # FP8_DYNAMIC: FP8 weights, a scale per row, FP8 inputs per token
        assert {expert + "weight", expert + "weight_scale"} <= keys.keys()
        assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
    else:  # W4A16: int4 packed eight to an int32, a scale per group of 32, the shape beside
        assert config["format"] == "pack-quantized"
        assert {expert + "weight_packed", expert + "weight_scale", expert + "weight_shape"} <= keys.keys()
        assert expert + "weight" not in keys
    assert "model.layers.0.mlp.gate.weight" in keys and "model.layers.0.mlp.gate.weight_scale" not in keys


def test_compressed_tensors_experts_are_transformers_own_bit_for_bit(ct_model):
    from transformers import AutoModelForCausalLM

    from kvasir_rpc import CtExpert

    index = ExpertIndex(ct_model)
    assert index.quant == ("ct-fp8" if "fp8" in ct_model.parent.name else "ct-int")
    model = AutoModelForCausalLM.from_pretrained(str(ct_model))  # compressed-tensors' decompressors
    for layer, experts in index.slices.items():
        module = model.model.layers[layer].mlp.experts
        for e in experts:
            held = index.load_quantized(layer, e)
            assert isinstance(held, CtExpert)
            gate_up, down = held.dequantize()
            assert gate_up.dtype == down.dtype == torch.bfloat16
            assert torch.equal(gate_up.view(torch.int16), module.gate_up_proj[e].view(torch.int16))
            assert torch.equal(down.view(torch.int16), module.down_proj[e].view(torch.int16))
    assert all(torch.equal(a, b) for a, b in zip(index.view(1, 5), index.load(1, 5)))


def test_a_worker_holds_compressed_tensors_experts_as_stored(ct_model):
    from kvasir_rpc import CtExpert, expert_digest
    from worker._load import load_experts

    experts = load_experts(ct_model, "0:0-3", "cpu")
    assert all(isinstance(w, CtExpert) for w in experts.weights.values())
    held = sum(w.nbytes for w in experts.weights.values())  # type: ignore[union-attr]
    index = ExpertIndex(ct_model)
    bf16 = sum(t.nbytes for e in range(4) for t in index.load(0, e))
    # FP8: a byte a weight and a bfloat16 scale per row; int4: half a byte and a scale per 32.
    assert held < (0.6 if index.quant == "ct-fp8" else 0.35) * bf16
    assert experts.expert_digests[(0, 2)] == expert_digest(*index.load(0, 2)) == index.expert_digest(0, 2)


def test_the_backbone_without_experts_computes_as_transformers_does(ct_model):
    # The dense layers decompressed by compressed-tensors' own code, and FP8_DYNAMIC's inputs
    # quantized per token as transformers' loaded model quantizes them: the same logits.
    from transformers import AutoModelForCausalLM

    from backbone.experts._weights import experts_modules, load_without_experts

    full = AutoModelForCausalLM.from_pretrained(str(ct_model))
    bare = load_without_experts(ct_model)
    mine = experts_modules(bare)
    for layer, module in experts_modules(full).items():
        for name, p in module.named_parameters():
            setattr(mine[layer], name, torch.nn.Parameter(p.detach().clone(), requires_grad=False))
    ids = torch.tensor([[1, 5, 9, 23, 77, 100, 3]])
    with torch.no_grad():
        assert torch.equal(full(ids).logits, bare(ids).logits)


def test_a_config_with_its_format_only_at_the_top_computes_the_same(ct_model, tmp_path):
    # Older llm-compressor releases name the format once, not per group.
    from backbone.experts._weights import load_without_experts

    moved = _edit_config(ct_model, tmp_path, lambda q: q["config_groups"]["group_0"].pop("format"))
    index = ExpertIndex(moved)
    assert index.quant == ExpertIndex(ct_model).quant
    assert all(torch.equal(a, b) for a, b in zip(index.load(2, 6), ExpertIndex(ct_model).load(2, 6)))
    dense = {k: v for k, v in load_without_experts(moved).state_dict().items() if not v.is_meta}
    same = load_without_experts(ct_model).state_dict()
    assert all(torch.equal(v, same[k]) for k, v in dense.items())


def _edit_config(model, tmp_path, edit):  # type: ignore[no-untyped-def]
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(model, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("edit,says", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "asymmetric"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "weights.actorder: .*removed"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[16, 16],
                                                                group_size=None), "per block"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparse"),
    (lambda q: q.update(format="nvfp4-pack-quantized") or q["config_groups"]["group_0"].update(
        format="nvfp4-pack-quantized"), "nvfp4"),
    (lambda q: q.update(config_groups={}), "no config_groups"),
])
def test_compressed_tensors_schemes_without_an_exact_reference_are_refused(tmp_path, edit, says):
    from kvasir.families import make_family_checkpoint

    model = make_family_checkpoint(tmp_path / "m", "qwen3_moe", dtype="bfloat16", quant="ct-int4")
    with pytest.raises(CheckpointError, match=says) as caught:
        ExpertIndex(_edit_config(model, tmp_path, edit))
    assert any(w in str(caught.value) for w in ("served", "nothing says", "compressed-tensors reads"))


def test_a_compressed_tensors_expert_without_its_scale_is_refused(tmp_path):
    from kvasir.families import make_family_checkpoint

    model = make_family_checkpoint(tmp_path / "m", "qwen3_moe", dtype="bfloat16", quant="ct-fp8")
    key = "model.layers.1.mlp.experts.2.down_proj.weight_scale"
    with pytest.raises(CheckpointError, match=r"expert \(1, 2\) lacks \['down_scale'\]"):
        ExpertIndex(_with_tensors(model, tmp_path, key, lambda t: t.pop(key)))


def test_a_compressed_tensors_expert_in_activation_order_is_refused(tmp_path):
    # A g_idx beside a packed weight (GPTQ's activation order): transformers' fused experts ignore
    # it, so no exact reference exists; the index says so rather than serve wrong weights.
    from kvasir.families import make_family_checkpoint

    model = make_family_checkpoint(tmp_path / "m", "qwen3_moe", dtype="bfloat16", quant="ct-int4")
    packed = "model.layers.2.mlp.experts.7.up_proj.weight_packed"

    def add_g_idx(tensors):  # type: ignore[no-untyped-def]
        tensors[packed.replace("_packed", "_g_idx")] = torch.arange(64, dtype=torch.int32) // 32

    with pytest.raises(CheckpointError, match=r"expert \(2, 7\) has \['up_g_idx'\]: .*activation orders"):
        ExpertIndex(_with_tensors(model, tmp_path, packed, add_g_idx))


def test_static_activation_scales_send_the_backbone_to_load_every_expert(tmp_path):
    # The on-demand backbone does not read input_scale tensors: it says so, and which path does.
    from backbone.experts._weights import load_without_experts
    from kvasir.families import make_family_checkpoint

    model = make_family_checkpoint(tmp_path / "m", "qwen3_moe", dtype="bfloat16", quant="ct-fp8")
    static = _edit_config(model, tmp_path, lambda q: q["config_groups"]["group_0"]["input_activations"].update(
        dynamic=False, strategy="tensor"))
    with pytest.raises(CheckpointError, match=r"static scales .*--expert-weights all"):
        load_without_experts(static)


def test_the_formats_bench_holds_each_format_in_its_stored_bytes():
    from kvasir.bench.formats import run_formats_bench

    result = run_formats_bench(quick=True, widths=(256, 128), say=lambda _: None)
    held = {name: f["held_vs_bfloat16"] for name, f in result["formats"].items()}  # type: ignore[attr-defined]
    assert held["bfloat16"] == 1.0
    assert 0.5 <= held["fp8"] < 0.52 and 0.5 <= held["ct-fp8"] < 0.52
    assert 0.25 <= held["mxfp4"] < 0.28 and 0.25 <= held["ct-int4"] < 0.28
