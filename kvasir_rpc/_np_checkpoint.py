"""A checkpoint's experts read with numpy, for a worker without torch: the bytes
``ExpertIndex`` locates (its ``_locs``), read from the safetensors files by their headers,
widened to float32 to compute with, and digested as ``expert_digest`` digests the tensors torch
would load (same dtype names, shapes and bytes), so a numpy worker announces the torch
worker's digest.

Quantized experts are dequantized as ``kvasir_rpc._quant`` does, bit for bit, where numpy can do
it exactly by tables: block FP8 (each code's value times its block's scale in float32, rounded
once to the model's dtype) and MXFP4 (each 4-bit value times its power of two). Compressed-tensors
releases are dequantized by that package's own code on torch: ``numpy_refusal`` says so."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import struct
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from kvasir_rpc._checkpoint import _HEADER_MAX, CheckpointError, _Loc, _moe_config
from kvasir_rpc._wire import bfloat16_bits

if TYPE_CHECKING:
    from kvasir_rpc._checkpoint import ExpertIndex

__all__ = ["NpExpert", "NpExpertReader", "dequantize_block_fp8_np", "dequantize_mxfp4_np", "fp8_e4m3_values",
           "numpy_refusal", "round_to_dtype"]

# safetensors' dtype codes: (numpy dtype the bytes are read as, torch's name for the dtype).
_DTYPES: dict[str, tuple[Any, str]] = {
    "F32": (np.float32, "float32"), "F16": (np.float16, "float16"), "BF16": (np.uint16, "bfloat16"),
    "F64": (np.float64, "float64"), "F8_E4M3": (np.uint8, "float8_e4m3fn"), "U8": (np.uint8, "uint8"),
    "I8": (np.int8, "int8"), "I16": (np.int16, "int16"), "I32": (np.int32, "int32"), "I64": (np.int64, "int64"),
}
_COMPUTE_DTYPES = ("float32", "float16", "bfloat16")


def numpy_refusal(model_dir: str | pathlib.Path) -> str:
    """Why a worker without torch cannot serve the checkpoint at ``model_dir`` ("" when it can,
    as far as its config says): compressed-tensors releases, and dtypes it does not compute."""
    cfg, text, _, _ = _moe_config(pathlib.Path(model_dir) / "config.json")
    quant = cfg.get("quantization_config") or text.get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in (None, "fp8", "mxfp4"):
        return (f"a {method} checkpoint is dequantized by torch code (the compressed-tensors package): the worker "
                "without torch serves float32, bfloat16 and float16 checkpoints and block-FP8 and MXFP4 releases; "
                "use the torch worker (pip install kvasir-rpc)")
    name = str(text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
               or "float32").replace("torch.", "")
    if name not in _COMPUTE_DTYPES:
        return f"a {name} model is not computed without torch (float32, bfloat16 and float16 are); use the torch worker"
    return ""


@functools.cache
def fp8_e4m3_values() -> np.ndarray:
    """[256] float32: each float8_e4m3fn code's value (sign, 4 exponent bits biased by 7, 3
    mantissa bits; subnormals below; 0x7F and 0xFF NaN), exactly as torch's cast gives it."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = (codes & 7).astype(np.float64)
    value = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * np.exp2(exp.astype(np.float64) - 7))
    value = sign * value
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


def round_to_dtype(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``x`` rounded to ``dtype`` (to nearest even, as torch's cast): ``(its bytes as
    stored [uint16 for bfloat16], its values widened back to float32)``."""
    if dtype == "float32":
        x = np.ascontiguousarray(x, dtype=np.float32)
        return x, x
    if dtype == "float16":
        with np.errstate(over="ignore"):  # beyond float16's range: infinity, as torch's cast gives
            h = np.ascontiguousarray(x.astype(np.float16))
        return h, h.astype(np.float32)
    if dtype == "bfloat16":
        bits = bfloat16_bits(x)
        return bits, (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    raise ValueError(f"cannot round to {dtype}")


def dequantize_block_fp8_np(q: np.ndarray, scale_inv: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``kvasir_rpc.dequantize_block_fp8`` on ``q`` (uint8 codes [rows, cols]) and ``scale_inv``
    (float32 [rows / bm, cols / bn]): ``round_to_dtype`` of each code's value times its block's
    scale in float32. Raises ValueError when the grid does not divide the weight."""
    rows, cols = q.shape[-2:]
    scale_rows, scale_cols = scale_inv.shape[-2:]
    if rows % scale_rows or cols % scale_cols:
        raise ValueError(f"weight [{rows}, {cols}] is not divisible by its scale grid [{scale_rows}, {scale_cols}]")
    block_m, block_n = rows // scale_rows, cols // scale_cols
    qf = fp8_e4m3_values()[q].reshape(scale_rows, block_m, scale_cols, block_n)
    s = scale_inv.astype(np.float32).reshape(scale_rows, 1, scale_cols, 1)
    return round_to_dtype((qf * s).reshape(rows, cols), dtype)


_FP4 = np.array((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0),
                dtype=np.float32)


def dequantize_mxfp4_np(blocks: np.ndarray, scales: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``kvasir_rpc.dequantize_mxfp4`` on ``blocks`` (uint8 [out, in / 32, 16], the low nibble
    first) and ``scales`` (uint8 [out, in / 32], exponents biased by 127): ``round_to_dtype`` of
    [in, out] (transposed, as gpt-oss's experts hold it)."""
    out_rows, groups, half = blocks.shape
    values = np.stack([_FP4[blocks & 0x0F], _FP4[blocks >> 4]], axis=-1).reshape(out_rows, groups, half * 2)
    e = scales.astype(np.int32) - 127
    power = np.ldexp(np.float32(1), np.minimum(e, 127)).astype(np.float32)  # exact powers of two
    with np.errstate(over="ignore"):  # beyond float32's range: infinity, as torch's product gives
        w = values * power[..., None]
        if bool((e > 127).any()):
            w = np.where((e > 127)[..., None], w * np.float32(2), w)
    return round_to_dtype(np.ascontiguousarray(w.reshape(out_rows, groups * half * 2).T), dtype)


def _digest(parts: list[tuple[str, np.ndarray]]) -> bytes:
    """``expert_digest`` of tensors given as (torch's dtype name, the bytes as stored, shaped)."""
    h = hashlib.sha256()
    for name, stored in parts:
        h.update(f"torch.{name}".encode() + b"\x00" + struct.pack(f"<{stored.ndim}Q", *stored.shape))
        h.update(np.ascontiguousarray(stored).reshape(-1).view(np.uint8).data)
    return h.digest()


def _widen(stored: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        return (stored.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if name in ("float32", "float16", "float64"):
        return np.ascontiguousarray(stored, dtype=np.float32)
    raise CheckpointError(f"expert weights stored as {name} are not computed without torch")


@dataclasses.dataclass(frozen=True)
class NpExpert:
    """One expert to compute with in float32, as torch's worker would hold it: ``gate_up``
    ([2I, H], [H, 2I] transposed), ``down`` ([H, I], [I, H]), ``biases`` or None; ``digest``
    what ``expert_digest`` gives the tensors torch loads; ``nbytes`` the float32 bytes held."""

    gate_up: np.ndarray
    down: np.ndarray
    biases: tuple[np.ndarray, np.ndarray] | None
    digest: bytes

    @property
    def nbytes(self) -> int:
        return int(self.gate_up.nbytes + self.down.nbytes)


class NpExpertReader:
    """Reads ``index``'s experts with numpy (one header read per file, then only each
    expert's bytes). ``load`` raises KeyError for an expert the checkpoint lacks and
    CheckpointError for bytes it cannot use (a format this reader does not dequantize, a
    file shorter than its header says)."""

    def __init__(self, index: ExpertIndex) -> None:
        self.index = index
        self.dtype = str(index.info.dtype_name)
        if self.dtype not in _COMPUTE_DTYPES:
            raise CheckpointError(f"{index.model_dir}: a {self.dtype} model is not computed without torch")
        if index.quant not in (None, "fp8", "mxfp4"):
            raise CheckpointError(f"{index.model_dir}: {numpy_refusal(index.model_dir)}")
        self._headers: dict[pathlib.Path, tuple[int, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def _header(self, file: pathlib.Path) -> tuple[int, dict[str, Any]]:
        with self._lock:
            held = self._headers.get(file)
        if held is not None:
            return held
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= _HEADER_MAX:
                raise CheckpointError(f"{file}: not a safetensors file (header length {n})")
            try:
                header = json.loads(f.read(n))
            except ValueError as exc:
                raise CheckpointError(f"{file}: its safetensors header is not JSON: {exc}") from None
        held = (8 + n, header)
        with self._lock:
            self._headers[file] = held
        return held

    def raw(self, loc: _Loc) -> tuple[np.ndarray, str]:
        """The tensor at ``loc`` as stored (a fused tensor's row ``loc.index``): (its bytes read
        as its numpy dtype, bfloat16 as uint16, and shaped; torch's name for its dtype)."""
        start, header = self._header(loc.file)
        meta = header.get(loc.key)
        try:
            np_dtype, name = _DTYPES[meta["dtype"]]  # type: ignore[index]
            shape = [int(d) for d in meta["shape"]]  # type: ignore[index]
            a, b = (int(x) for x in meta["data_offsets"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{loc.file}: tensor {loc.key!r} has a header entry this reader cannot use: "
                                  f"{meta!r:.200}") from None
        itemsize = np.dtype(np_dtype).itemsize
        if b - a != math.prod(shape) * itemsize:
            raise CheckpointError(f"{loc.file}: tensor {loc.key!r}: {b - a} bytes for shape {shape} of {name}")
        if loc.index is not None:
            per = (b - a) // shape[0]
            a, shape = a + loc.index * per, shape[1:]
            b = a + per
        with open(loc.file, "rb") as f:
            f.seek(start + a)
            data = f.read(b - a)
        if len(data) != b - a:
            raise CheckpointError(f"{loc.file} is shorter than its header says; was it changed while in use?")
        return np.frombuffer(data, dtype=np_dtype).reshape(shape), name

    def load(self, layer: int, expert: int) -> NpExpert:
        """One expert: its float32 weights to compute with, its biases, its digest."""
        slot = self.index._locs[(layer, expert)]
        if self.index.quant == "fp8":
            parts = []
            for p in ("gate", "up", "down"):
                (q, qn), (s, sn) = self.raw(slot[p]), self.raw(slot[p + "_scale"])
                if qn not in ("float8_e4m3fn", "uint8"):
                    raise CheckpointError(f"{self.index.model_dir}: block-FP8 weight {slot[p].key} is {qn}")
                parts.append(dequantize_block_fp8_np(q, _widen(s, sn), self.dtype))
            stored_gu = np.concatenate([parts[0][0], parts[1][0]], axis=0)
            gate_up = np.concatenate([parts[0][1], parts[1][1]], axis=0)
            stored = [(self.dtype, stored_gu), (self.dtype, parts[2][0])]
            down = parts[2][1]
        elif self.index.quant == "mxfp4":
            gu_s, gu = dequantize_mxfp4_np(self.raw(slot["gate_up_proj_blocks"])[0],
                                           self.raw(slot["gate_up_proj_scales"])[0], self.dtype)
            d_s, down = dequantize_mxfp4_np(self.raw(slot["down_proj_blocks"])[0],
                                            self.raw(slot["down_proj_scales"])[0], self.dtype)
            gate_up, stored = gu, [(self.dtype, gu_s), (self.dtype, d_s)]
        elif "gate_up_proj" in slot:
            (gu_s, gu_n), (d_s, d_n) = self.raw(slot["gate_up_proj"]), self.raw(slot["down_proj"])
            stored = [(gu_n, gu_s), (d_n, d_s)]
            gate_up, down = _widen(gu_s, gu_n), _widen(d_s, d_n)
        else:
            (g, gn), (u, un), (d_s, d_n) = (self.raw(slot[p]) for p in ("gate", "up", "down"))
            if gn != un:
                raise CheckpointError(f"{self.index.model_dir}: expert {(layer, expert)}: gate {gn}, up {un}")
            gu_s = np.concatenate([g, u], axis=0)
            stored = [(gn, gu_s), (d_n, d_s)]
            gate_up, down = _widen(gu_s, gn), _widen(d_s, d_n)
        biases = None
        if "gate_up_proj_bias" in slot:
            (bg, bgn), (bd, bdn) = self.raw(slot["gate_up_proj_bias"]), self.raw(slot["down_proj_bias"])
            stored += [(bgn, bg), (bdn, bd)]
            biases = (_widen(bg, bgn), _widen(bd, bdn))
        return NpExpert(np.ascontiguousarray(gate_up), np.ascontiguousarray(down), biases, _digest(stored))
