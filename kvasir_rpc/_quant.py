"""Quantized checkpoints as they ship: block FP8 (DeepSeek-V3/R1's and Qwen3's official FP8
releases: ``quant_method: "fp8"``, each linear weight stored ``float8_e4m3fn`` with a float32
``weight_scale_inv`` per block, 128 x 128 in the releases).

``dequantize_block_fp8`` is transformers' own dequantization (``Fp8Dequantize`` in
``transformers.integrations.finegrained_fp8``, what ``from_pretrained`` runs on a CPU): each
weight times its block's scale in float32, rounded once to the model's dtype. A worker and the
backbone that dequantize so hold, bit for bit, the weights transformers' model holds.

``QuantizedExpert`` keeps one expert as the checkpoint stores it (its FP8 bytes and scales:
about half its bfloat16 size) and dequantizes when a call needs it.

``quantize_block_fp8`` / ``write_fp8_release`` make such a checkpoint from a bfloat16 one (the
release format: the same keys, ``_scale_inv`` beside each quantized weight, the config's
``quantization_config``), for tests and demos: no hub download.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["FP4_VALUES", "FP8_MAX", "Mxfp4Expert", "QuantizedExpert", "QuantizedWeights", "dequantize_block_fp8",
           "dequantize_mxfp4", "quantize_block_fp8", "quantize_mxfp4", "write_fp8_release", "write_mxfp4_release"]

#: The largest finite float8_e4m3fn.
FP8_MAX = 448.0
#: What a release's quantization_config says (DeepSeek-V3's and Qwen3's FP8 releases).
_FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
# Left in the model's dtype by the releases: embeddings, the head, norms, routers.
_NOT_QUANTIZED = re.compile(r"(embed|lm_head|norm|\.gate\.weight$|router|\.mlp\.gate\.)")


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` [rows, cols] float8 times ``scale_inv`` [rows / bm, cols / bn] (one per block of the
    grid the scales' shape gives), in float32, rounded to ``dtype``: transformers' formula,
    operation for operation. Raises ValueError when the grid does not divide the weight."""
    import torch

    rows, cols = q.shape[-2:]
    scale_rows, scale_cols = scale_inv.shape[-2:]
    if rows % scale_rows or cols % scale_cols:  # transformers refuses it too
        raise ValueError(f"weight [{rows}, {cols}] is not divisible by its scale grid [{scale_rows}, {scale_cols}]")
    block_m, block_n = rows // scale_rows, cols // scale_cols
    # float8 to float32 by a table of the 256 codes (exact, as the cast is; twice as fast here).
    qf = _fp8_table().take(q.view(torch.uint8).long()) if q.dtype == torch.float8_e4m3fn else q.to(torch.float32)
    qf = qf.reshape(-1, scale_rows, block_m, scale_cols, block_n)
    s = scale_inv.to(torch.float32).reshape(-1, scale_rows, scale_cols).unsqueeze(-1).unsqueeze(2)
    return (qf * s).to(dtype).reshape(rows, cols)


@functools.cache
def _fp8_table() -> torch.Tensor:
    """Every float8_e4m3fn code's value in float32 (NaN for the two NaN codes)."""
    import torch

    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def quantize_block_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [rows, cols], scale_inv float32 [ceil(rows/block), ceil(cols/block)])``
    with each block's largest magnitude at FP8_MAX, as the releases were made."""
    import torch

    rows, cols = w.shape
    sr, sc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(sr * block, sc * block)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(sr, block, sc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).reshape(sr * block, sc * block)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.float()


class QuantizedWeights:
    """An expert held as its checkpoint stores it, dequantized when a call needs it."""

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up, down)`` as ``ExpertIndex.load`` gives them."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def to(self, device: torch.device) -> QuantizedWeights:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class QuantizedExpert(QuantizedWeights):
    """One expert as a block-FP8 checkpoint stores it: gate, up [I, H] and down [H, I] in
    float8_e4m3fn with their scales; ``dequantize`` gives ``(gate_up [2I, H], down [H, I])`` in
    ``dtype``, bit for bit what ``ExpertIndex.load`` and transformers' model hold."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_scale: torch.Tensor
    up_scale: torch.Tensor
    down_scale: torch.Tensor
    dtype: torch.dtype

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        from kvasir_rpc._kernel import _aligned

        gate_up = torch.cat([dequantize_block_fp8(self.gate, self.gate_scale, self.dtype),
                             dequantize_block_fp8(self.up, self.up_scale, self.dtype)], dim=0)
        return gate_up, _aligned(dequantize_block_fp8(self.down, self.down_scale, self.dtype).contiguous())

    @property
    def nbytes(self) -> int:
        """Bytes held: the FP8 weights and their scales."""
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down, self.gate_scale,
                                                           self.up_scale, self.down_scale))

    def to(self, device: torch.device) -> QuantizedExpert:
        return dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in
                                            ("gate", "up", "down", "gate_scale", "up_scale", "down_scale")})


def write_fp8_release(src: pathlib.Path, dst: pathlib.Path, *, block: int = 128) -> pathlib.Path:
    """Write ``src`` (a bfloat16 checkpoint in safetensors shards) to ``dst`` as a block-FP8
    release is laid out: every linear weight but the embeddings, the head, norms and routers in
    float8_e4m3fn with ``<name>_scale_inv`` beside it (same shard), the index updated, and the
    config's ``quantization_config`` (``weight_block_size`` [block, block]). Other files copied."""

    def convert(key: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if key.endswith(".weight") and t.dim() == 2 and not _NOT_QUANTIZED.search(key):
            q, scale_inv = quantize_block_fp8(t, block)
            return {key: q, key + "_scale_inv": scale_inv}
        return None

    return _rewrite_release(src, dst, convert, {**_FP8_CONFIG, "weight_block_size": [block, block]})


def _rewrite_release(src: pathlib.Path, dst: pathlib.Path,
                     convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor] | None],
                     quantization_config: dict[str, Any]) -> pathlib.Path:
    """``src``'s safetensors shards written to ``dst`` with each tensor ``convert`` turns into
    others (None: kept as it is), the index's weight map updated, ``quantization_config`` in the
    config, and every other file copied. Raises ValueError when ``convert`` changed nothing."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    index_path = src / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index_path.read_text())["weight_map"].values())) if index_path.exists()
             else sorted(p.name for p in src.glob("*.safetensors")))
    weight_map: dict[str, str] = {}
    converted = 0
    for name in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(src / name), framework="pt") as h:
            for key in h.keys():
                t = h.get_tensor(key)
                new = convert(key, t)
                converted += new is not None
                out.update(new if new is not None else {key: t})
        save_file(out, str(dst / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in out})
    if not converted:
        raise ValueError(f"{src}: no tensor to quantize ({quantization_config['quant_method']})")
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        (dst / index_path.name).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json", index_path.name):
            shutil.copy2(p, dst / p.name)
    return dst


# --- MXFP4 (gpt-oss's release) ----------------------------------------------------------------

#: The 16 float4 (e2m1) values, by nibble: transformers' (and OpenAI's) table.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per scale (one E8M0 exponent byte per 32 values)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's MXFP4 weight: ``blocks`` uint8 [out, in / 32, 16] (two float4 values a byte,
    the low nibble first) and ``scales`` uint8 [out, in / 32] (exponents biased by 127), to
    ``dtype`` [in, out] (transposed, as gpt-oss's experts hold it): the values of transformers'
    ``convert_moe_packed_tensors``, bit for bit. Each float4 value times its power of two is
    exact in float32 and rounds once to ``dtype``, as transformers' table in ``dtype`` and its
    ``ldexp`` give; by a table of the 256 bytes' value pairs, three times faster."""
    import torch

    out_rows, groups, half = blocks.shape
    pairs = _fp4_pair_table().index_select(0, blocks.reshape(-1).to(torch.int64))  # [n, 2] (low, high)
    values = pairs.reshape(out_rows, groups, half * 2)
    # The power of two in float32 up to 2^127; the byte 255 (2^128) as 2^127 and a factor 2 more,
    # so that 0.5 * 2^128 stays finite, as ldexp keeps it.
    e = scales.to(torch.int32) - 127
    w = values * torch.exp2(e.clamp(max=127).to(torch.float32))[..., None]
    if bool((e > 127).any()):
        w = torch.where((e > 127)[..., None], w * 2.0, w)
    w = w.to(dtype).reshape(out_rows, groups * half * 2)
    return w.transpose(0, 1).contiguous()


@functools.cache
def _fp4_pair_table() -> torch.Tensor:
    """[256, 2] float32: a byte's two float4 values, the low nibble's first."""
    import torch

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=1).contiguous()


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [in, out] (gpt-oss's orientation) as MXFP4: ``(blocks uint8 [out, in / 32, 16],
    scales uint8 [out, in / 32])``, each block of 32 inputs scaled by a power of two so that its
    largest magnitude fits the float4 range, each value rounded to the nearest float4."""
    import torch

    wt = w.float().transpose(0, 1)  # [out, in]
    out_rows, inputs = wt.shape
    if inputs % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {MXFP4_BLOCK}, got {inputs}")
    g = wt.reshape(out_rows, inputs // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = g.abs().amax(dim=-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # the block's largest magnitude within 6
    scaled = g / torch.exp2(exp)[..., None]
    table = torch.tensor(FP4_VALUES[:8])
    idx = (scaled.abs()[..., None] - table).abs().argmin(dim=-1)  # nearest magnitude
    nib = (idx + 8 * (scaled < 0).long()).to(torch.uint8)
    nib = nib.reshape(out_rows, inputs // MXFP4_BLOCK, MXFP4_BLOCK // 2, 2)
    blocks = (nib[..., 0] | (nib[..., 1] << 4)).to(torch.uint8)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


@dataclasses.dataclass(frozen=True)
class Mxfp4Expert(QuantizedWeights):
    """One expert of an MXFP4 checkpoint (gpt-oss's release) as stored: the gate_up and down
    blocks and scales (about 0.27 of the bfloat16 bytes); ``dequantize`` gives ``(gate_up [H, 2I],
    down [I, H])`` in ``dtype``, bit for bit what transformers' model holds."""

    gate_up_blocks: torch.Tensor
    gate_up_scales: torch.Tensor
    down_blocks: torch.Tensor
    down_scales: torch.Tensor
    dtype: torch.dtype

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        from kvasir_rpc._kernel import _aligned

        return (_aligned(dequantize_mxfp4(self.gate_up_blocks, self.gate_up_scales, self.dtype)),
                _aligned(dequantize_mxfp4(self.down_blocks, self.down_scales, self.dtype)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up_blocks, self.gate_up_scales, self.down_blocks,
                                                           self.down_scales))

    def to(self, device: torch.device) -> Mxfp4Expert:
        return dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in
                                            ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")})


def write_mxfp4_release(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """Write ``src`` (a bfloat16 gpt-oss checkpoint: fused experts stored [E, H, 2I] and
    [E, I, H]) to ``dst`` as gpt-oss's release lays it out: each experts weight as
    ``<name>_blocks`` [E, out, in / 32, 16] and ``<name>_scales`` [E, out, in / 32] (uint8), the
    rest (attention, router, biases, embeddings) as it is, and ``quantization_config``
    ``{"quant_method": "mxfp4"}``. Other files copied. Raises ValueError for a checkpoint
    without fused experts weights."""
    import torch

    def convert(key: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")) and t.dim() == 3:
            blocks, scales = zip(*(quantize_mxfp4(t[e]) for e in range(t.shape[0])))
            return {key + "_blocks": torch.stack(blocks), key + "_scales": torch.stack(scales)}
        return None

    return _rewrite_release(src, dst, convert, {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"]})
