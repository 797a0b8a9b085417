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

Also here: MXFP4 (gpt-oss's release; ``Mxfp4Expert``) and compressed-tensors (llm-compressor's
FP8 and int4 releases; ``CtExpert``, dequantized by compressed-tensors' own code, which is what
transformers runs), each with its writer.
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

__all__ = ["CT_COMPANIONS", "CT_KINDS", "CT_TENSORS", "FP4_VALUES", "FP8_MAX", "CtExpert", "CtScheme", "Mxfp4Expert",
           "QuantizedExpert", "QuantizedWeights", "compress_ct", "ct_experts_scheme", "ct_scheme_of",
           "decompress_now", "dequantize_block_fp8", "dequantize_ct", "dequantize_ct_dense", "dequantize_mxfp4",
           "quantize_block_fp8", "quantize_ct_activations", "quantize_mxfp4", "write_ct_release", "write_fp8_release",
           "write_mxfp4_release"]

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
    qf = _as_float32(q).reshape(-1, scale_rows, block_m, scale_cols, block_n)
    s = scale_inv.to(torch.float32).reshape(-1, scale_rows, scale_cols).unsqueeze(-1).unsqueeze(2)
    # In place on the fresh float32 copy: the same products, without a second full-size tensor.
    return qf.mul_(s).to(dtype).reshape(rows, cols)


def _as_float32(q: torch.Tensor) -> torch.Tensor:
    """``q`` as a fresh float32 tensor (the caller may write to it): float8 by a table of the 256
    codes (exact, as the cast is; twice as fast here), anything else by a copying cast."""
    import torch

    if q.dtype == torch.float8_e4m3fn:
        return _fp8_table().take(q.view(torch.uint8).long())
    return q.to(torch.float32, copy=True)


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


# --- compressed-tensors (llm-compressor's releases: most community FP8 and int4 checkpoints) ---

#: What ``ExpertIndex.quant`` says of a compressed-tensors checkpoint, by its experts' format.
CT_KINDS = {"float-quantized": "ct-fp8", "pack-quantized": "ct-int"}
#: The tensors each kind keeps beside a weight (by projection), as the checkpoint names them.
CT_TENSORS = {"ct-fp8": ("weight", "weight_scale"), "ct-int": ("weight_packed", "weight_scale", "weight_shape")}


@dataclasses.dataclass(frozen=True)
class CtScheme:
    """How a compressed-tensors checkpoint quantizes its experts: ``kind`` ("ct-fp8", float8
    weights with a scale per output row or per tensor; "ct-int", symmetric integers of ``bits``
    packed eight (4-bit) to an int32, a scale per ``group_size`` inputs or per row), and the
    package's scheme object (``compressed_tensors.quantization.QuantizationScheme``)."""

    kind: str
    bits: int
    strategy: str
    group_size: int | None
    scheme: Any

    def describe(self) -> str:
        if self.kind == "ct-fp8":
            return f"compressed-tensors FP8 (scale per {self.strategy})"
        per = f"group of {self.group_size}" if self.strategy == "group" else self.strategy
        return f"compressed-tensors int{self.bits} weight-only (symmetric, scale per {per})"


def ct_experts_scheme(quantization_config: dict[str, Any]) -> CtScheme:
    """The scheme of the config group quantizing the experts (the group transformers picks,
    ``get_experts_scheme``: the one whose ``re:`` targets name the experts, else the first
    class-name group). Raises ValueError, in a line that says what is served, for what
    transformers cannot load exactly on a CPU or this project does not serve: asymmetric
    integers (transformers' fused experts drop the zero points), FP8 in blocks (transformers
    cannot broadcast the scales), sparse formats, NVFP4/MXFP4 and other formats (activation
    orders stored as ``weight_g_idx`` are refused by ``ExpertIndex``, which sees the tensors)."""
    from transformers.integrations.compressed_tensors import get_experts_scheme

    served = ("served: float-quantized FP8 with a scale per channel or tensor, and pack-quantized symmetric "
              "integers (W4A16, W8A16) with a scale per group or channel")
    if quantization_config.get("sparsity_config"):
        raise ValueError(f"sparse compressed-tensors checkpoints are not served ({served})")
    config = _ct_config(quantization_config)
    if not config.config_groups:
        raise ValueError("quantization_config has no config_groups: nothing says how the experts are stored")
    scheme = get_experts_scheme(config)
    weights = scheme.weights
    fmt = str(scheme.format or config.format)
    kind = CT_KINDS.get(fmt)
    if weights is None or kind is None:
        raise ValueError(f"experts in compressed-tensors format {fmt!r} are not served ({served})")
    strategy = str(getattr(weights.strategy, "value", weights.strategy))
    typ = str(getattr(weights.type, "value", weights.type))
    if kind == "ct-fp8" and not (typ == "float" and weights.num_bits == 8 and strategy in ("channel", "tensor")):
        raise ValueError(f"float-quantized experts of {weights.num_bits} bits per {strategy} are not served ({served})")
    if kind == "ct-int":
        if typ != "int" or strategy not in ("group", "channel"):
            raise ValueError(f"pack-quantized {typ} experts per {strategy} are not served ({served})")
        if not weights.symmetric:
            raise ValueError("asymmetric integer experts (zero points) are not served: transformers' fused experts "
                             f"drop the zero points, so no exact reference exists ({served})")
    return CtScheme(kind, int(weights.num_bits), strategy, weights.group_size, scheme)


def _ct_config(quantization_config: dict[str, Any]) -> Any:
    """The config as compressed-tensors reads it (its ``QuantizationConfig``; the keys only
    transformers reads left out). Raises ValueError for one it cannot read."""
    from compressed_tensors.quantization import QuantizationConfig

    try:
        return QuantizationConfig.model_validate(
            {k: v for k, v in quantization_config.items() if k not in ("quant_method", "sparsity_config",
                                                                       "transform_config", "version")})
    except Exception as exc:  # pydantic's ValidationError (what and where), or whatever it raises
        errors = getattr(exc, "errors", None)
        first = errors()[0] if callable(errors) and errors() else None
        said = (f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}" if first
                else str(exc).strip().splitlines()[0])
        raise ValueError(f"quantization_config is not a compressed-tensors config compressed-tensors reads: {said}"
                         ) from None


def dequantize_ct(kind: str, scheme: Any, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One compressed-tensors weight ([out, in]) in ``dtype``, as transformers' loader gives it
    (``CompressedTensorsDequantize``): FP8 times its scale in float32, rounded once; packed
    integers through compressed-tensors' own decompressor (the code transformers runs)."""
    import torch

    if kind == "ct-fp8":
        q, scale = tensors["weight"], tensors["weight_scale"]
        return (_as_float32(q) * scale.to(torch.float32)).to(dtype)
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    return compressor.decompress(dict(tensors), scheme)["weight"].to(dtype)


@dataclasses.dataclass(frozen=True)
class CtExpert(QuantizedWeights):
    """One expert of a compressed-tensors checkpoint as stored: per projection (``gate``,
    ``up``, ``down``) the tensors ``CT_TENSORS[kind]`` names; ``dequantize`` gives ``(gate_up
    [2I, H], down [H, I])`` in ``dtype``, bit for bit what transformers' model holds."""

    kind: str
    scheme: Any
    parts: dict[str, dict[str, torch.Tensor]]
    dtype: torch.dtype

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        from kvasir_rpc._kernel import _aligned

        w = {p: dequantize_ct(self.kind, self.scheme, self.parts[p], self.dtype) for p in ("gate", "up", "down")}
        return torch.cat([w["gate"], w["up"]], dim=0), _aligned(w["down"].contiguous())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for part in self.parts.values() for t in part.values())

    def to(self, device: torch.device) -> CtExpert:
        return dataclasses.replace(self, parts={p: {k: t.to(device) for k, t in part.items()}
                                                for p, part in self.parts.items()})


def ct_scheme_of(kind: str, group_size: int = 128) -> CtScheme:
    """The scheme llm-compressor writes for ``kind``: "fp8" (FP8_DYNAMIC's weights: float8 with
    a scale per output row) or "int4" (W4A16: symmetric int4, a scale per ``group_size``)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if kind == "fp8":
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        return CtScheme("ct-fp8", 8, "channel", None,
                        QuantizationScheme(targets=["Linear"], weights=args, format="float-quantized"))
    if kind == "int4":
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
        return CtScheme("ct-int", 4, "group", group_size,
                        QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized"))
    raise ValueError(f"kind must be fp8 or int4, got {kind!r}")


def compress_ct(ct: CtScheme, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``w`` [out, in] as a compressed-tensors release stores it under ``ct`` (local names:
    ``weight``/``weight_packed``, ``weight_scale``, ``weight_shape``): the scales as
    llm-compressor's min-max observer makes them (``calculate_qparams``), in ``w``'s dtype,
    then compressed-tensors' own quantizer and packer."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = ct.scheme.weights
    x = w.float()
    if ct.strategy == "group":
        x = x.reshape(x.shape[0], -1, int(ct.group_size or 0))
    per_row = ct.strategy == "channel"
    scale, zero = calculate_qparams(x.amin(-1, keepdim=per_row), x.amax(-1, keepdim=per_row), args)
    compressor = BaseCompressor.get_value_from_registry(str(ct.scheme.format))
    stored = compressor.compress({"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero},
                                 ct.scheme)
    return {name: value.contiguous() for name, value in stored.items()}


def write_ct_release(src: pathlib.Path, dst: pathlib.Path, *, kind: str, group_size: int = 128) -> pathlib.Path:
    """Write ``src`` (a bfloat16 checkpoint with per-expert tensors) to ``dst`` as llm-compressor
    lays out a compressed-tensors release: every linear weight but the embeddings, the head,
    norms and routers quantized, ``kind`` "fp8" (FP8_DYNAMIC's weights: float8_e4m3fn with a
    scale per output row) or "int4" (W4A16: symmetric 4-bit integers packed in int32, a scale
    per ``group_size`` inputs, the shape beside), with compressed-tensors' own quantizer and
    packer, and the config's ``quantization_config`` (a dense layer whose width is not a multiple
    of ``group_size`` left unquantized and named in its ``ignore``). Raises ValueError when no
    tensor is quantized or an expert's width is not a multiple of ``group_size``."""
    ct = ct_scheme_of(kind, group_size)
    activations = ({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
                   if kind == "fp8" else None)  # FP8_DYNAMIC quantizes the dense layers' inputs per token
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*router$"]

    def convert(key: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not (key.endswith(".weight") and t.dim() == 2 and not _NOT_QUANTIZED.search(key)):
            return None
        if kind == "int4" and t.shape[1] % group_size:
            if ".experts." in key:
                raise ValueError(f"{key}: {t.shape[1]} inputs are not a multiple of the group size {group_size}")
            ignore.append(key[: -len(".weight")])  # left in bfloat16, as a release ignores a narrow layer
            return None
        base = key[: -len("weight")]
        return {base + name: value for name, value in compress_ct(ct, t).items()}

    group = {"targets": ["Linear"], "weights": ct.scheme.weights.model_dump(mode="json"),
             "input_activations": activations, "output_activations": None, "format": ct.scheme.format}
    fmt = ct.scheme.format
    return _rewrite_release(src, dst, convert, {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": group}, "ignore": ignore,
        "kv_cache_scheme": None, "sparsity_config": {}})


#: The tensors a compressed-tensors module may keep beside (or instead of) its ``weight``.
CT_COMPANIONS = ("weight_scale", "weight_packed", "weight_shape", "weight_zero_point", "weight_g_idx",
                 "weight_global_scale", "input_scale", "input_global_scale", "input_zero_point")


def dequantize_ct_dense(quantization_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                        dtype: torch.dtype) -> torch.Tensor:
    """A dense (not expert) module's weight from its compressed-tensors tensors (local names:
    ``weight`` or ``weight_packed``, ``weight_scale``...), as transformers' loaded model holds
    it: compressed-tensors' decompressor for the dense layers' scheme (``get_dense_scheme``),
    the code transformers runs when it decompresses the model. Raises ValueError for a config
    compressed-tensors cannot read."""
    from compressed_tensors.compressors import BaseCompressor
    from transformers.integrations.compressed_tensors import get_dense_scheme

    config = _ct_config(quantization_config)
    scheme = get_dense_scheme(config)
    compressor = BaseCompressor.get_value_from_registry(str(scheme.format or config.format))
    return compressor.decompress(dict(tensors), scheme)["weight"].to(dtype)


def quantize_ct_activations(model: torch.nn.Module, quantization_config: dict[str, Any]) -> int:
    """Give ``model`` (its dense weights already decompressed) the activation quantization a
    compressed-tensors config asks for (FP8_DYNAMIC's per-token FP8 inputs...), as
    transformers' loaded model runs it: compressed-tensors' ``apply_quantization_config`` with
    every quantized module marked decompressed, so its forward fake-quantizes the activations
    and leaves the weights as they are. Returns the number of modules; 0, and nothing done,
    when no group quantizes activations. Raises ValueError for static activation scales (the
    checkpoint's ``input_scale``: not read here)."""
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config

    config = _ct_config(quantization_config)
    activations = [a for g in config.config_groups.values() for a in (g.input_activations, g.output_activations)
                   if a is not None]
    if not activations:
        return 0
    if any(not a.dynamic for a in activations):
        raise ValueError("activations quantized with static scales (input_scale in the checkpoint) are served only "
                         "by a backbone that loads every expert (--expert-weights all)")
    apply_quantization_config(model, config, run_compressed=False)
    count = 0
    for module in model.modules():
        if hasattr(module, "quantization_status"):
            module.quantization_status = QuantizationStatus.DECOMPRESSED
            # The weights' quantization parameters it made: unset, and never read once decompressed.
            for name in ("weight_scale", "weight_zero_point", "weight_global_scale", "weight_g_idx"):
                module._parameters.pop(name, None)
            count += 1
    return count


def decompress_now(model: torch.nn.Module) -> bool:
    """Decompress a compressed-tensors model transformers loaded, now. Left to itself it
    decompresses on its first forward (a hook), and two threads' first forwards at once (the
    backbone's decode groups) both decompress and fail. True when there was one to do."""
    if not hasattr(model, "ct_decompress_hook"):
        return False
    quantizer = getattr(model, "hf_quantizer", None)
    compressor = getattr(quantizer, "compressor", None)
    if compressor is None:
        return False
    compressor.decompress_model(model)  # removes the hook
    return True
