"""Reading the experts of a Hugging Face MoE checkpoint: which (layer, expert) slices it has,
loading one slice lazily from safetensors, digests of slice weights, and the SPEC syntax
that names slices on the command line.

Published checkpoints store each expert as separate tensors
(``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``; Mixtral names them
``block_sparse_moe.experts.E.{w1,w3,w2}.weight``); some store the fused 3D form
(``...experts.gate_up_proj`` [E, 2I, H] and ``...experts.down_proj`` [E, H, I], with
``..._bias`` [E, 2I] and [E, H] where the experts have biases; gpt-oss and Aria store them
transposed, [E, H, 2I] and [E, I, H]), under transformers' names or the older ones its
conversion mapping renames (GraniteMoE's ``block_sparse_moe.input_linear.weight`` /
``output_linear.weight``, Aria's ``mlp.experts.fc1.weight`` / ``fc2.weight``). All are read
here, through ``safe_open`` so only the requested bytes are read from disk, or mapped
(``ExpertIndex.view``) so they are not even copied. An expert's weights are kept as the
checkpoint stores them; ``ExpertIndex.function`` says how to compute with them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import mmap
import os
import pathlib
import re
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from kvasir_rpc.protocol import WEIGHTS_DIGEST_DOMAIN

if TYPE_CHECKING:
    import torch

    from kvasir_rpc._function import ExpertFunction
    from kvasir_rpc._quant import CtScheme, QuantizedWeights

__all__ = [
    "CHECKPOINT_HINT",
    "CheckpointError",
    "ExpertIndex",
    "ModelInfo",
    "SpecError",
    "check_checkpoint",
    "format_slices",
    "parse_expert_spec",
    "slices_digest",
]

_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe|ffn)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<kind>weight|weight_scale_inv|weight_scale|weight_packed"
    r"|weight_shape|weight_zero_point|weight_g_idx)$"
)
_FUSED = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\."
    r"(?:experts\.(?P<proj>gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias"
    r"|gate_up_proj_blocks|gate_up_proj_scales|down_proj_blocks|down_proj_scales)"
    r"|(?P<old>input_linear|output_linear|experts\.fc1|experts\.fc2)\.weight)$"
)
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# A per-expert weight's companions, by the suffix its slot name takes: a block-FP8 release's
# weight_scale_inv; a compressed-tensors release's weight_scale, weight_packed, weight_shape
# (and the zero points and activation orders it may have, refused in ExpertIndex).
_KIND = {"weight": "", "weight_scale_inv": "_scale", "weight_scale": "_scale", "weight_packed": "_packed",
         "weight_shape": "_shape", "weight_zero_point": "_zero_point", "weight_g_idx": "_g_idx"}
# The fused tensors' older names that transformers' conversion mapping renames on load.
_OLD_FUSED = {"input_linear": "gate_up_proj", "output_linear": "down_proj", "experts.fc1": "gate_up_proj",
              "experts.fc2": "down_proj"}


def _fused_proj(m: re.Match[str]) -> str:
    """The transformers name of a fused tensor ``_FUSED`` matched."""
    return m["proj"] or _OLD_FUSED[m["old"]]


class CheckpointError(ValueError):
    """The checkpoint folder is missing files or tensors we need."""


class SpecError(ValueError):
    """An expert SPEC string does not parse or names slices the model does not have."""


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The few config facts the experts path needs."""

    model_type: str
    num_layers: int
    num_experts: int
    hidden_size: int
    intermediate_size: int
    hidden_act: str
    dtype_name: str  # torch's name for the config's dtype: "float32", "bfloat16"...

    @property
    def dtype(self) -> torch.dtype:
        """The config's dtype as torch's (imported here: a worker without torch reads ``dtype_name``)."""
        import torch

        return getattr(torch, self.dtype_name)  # type: ignore[no-any-return]


def _text_config(cfg: dict) -> dict:  # type: ignore[type-arg]
    return cfg.get("text_config", cfg)


def _moe_config(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, Any], Any, Any]:
    """``config.json`` at ``path`` read and checked to be a Mixture-of-Experts model's (torch
    not imported): (config, its text config, experts per layer, expert intermediate size)."""
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} not found: --model must be a Hugging Face checkpoint folder") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} is not a model config (a JSON object)")
    text = _text_config(cfg)
    # transformers' names for the count (a family that calls it otherwise, n_routed_experts or
    # moe_num_experts, aliases one of them in its config class's attribute_map); where the
    # config.json holds neither, the checkpoint's expert tensors say it.
    num_experts = text.get("num_experts") or text.get("num_local_experts")
    inter = text.get("moe_intermediate_size", text.get("intermediate_size"))
    if not num_experts:
        num_experts, tensors_inter = _experts_in_tensors(path.parent)
        inter = inter if inter is not None else tensors_inter
        if not num_experts:
            raise CheckpointError(f"{path}: not a Mixture-of-Experts checkpoint (its config names no num_experts / "
                                  "num_local_experts, and its safetensors files hold no expert tensors)")
    if inter is None:
        raise CheckpointError(f"{path}: no moe_intermediate_size / intermediate_size")
    missing = [k for k in ("num_hidden_layers", "hidden_size") if k not in text]
    if missing:
        raise CheckpointError(f"{path}: not a model config this project reads (no {', '.join(missing)})")
    return cfg, text, num_experts, inter


def _tensor_shapes(folder: pathlib.Path) -> dict[str, list[int]]:
    """Every tensor's shape in the safetensors files of ``folder``, from their headers alone
    (8 bytes of little-endian length, then JSON); a file that does not parse is passed over."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n)) if 0 < n <= _HEADER_MAX else {}
        except (OSError, ValueError):
            continue
        if isinstance(header, dict):
            shapes.update({k: list(v["shape"]) for k, v in header.items()
                           if isinstance(v, dict) and isinstance(v.get("shape"), list)})
    return shapes


def _experts_in_tensors(folder: pathlib.Path) -> tuple[int, int | None]:
    """``(experts per layer, their intermediate width)`` as the checkpoint's expert tensors
    show them (per expert: the highest expert id + 1 and a gate's rows; fused: the first and
    second dimensions), or ``(0, None)`` when it holds none."""
    experts, inter = 0, None
    for key, shape in _tensor_shapes(folder).items():
        if m := _PER_EXPERT.match(key):
            experts = max(experts, int(m["expert"]) + 1)
            if _PROJ[m["proj"]] == "gate" and m["kind"] == "weight" and len(shape) == 2:
                inter = shape[0]
        elif (m := _FUSED.match(key)) and _fused_proj(m) == "down_proj" and len(shape) == 3:
            experts, inter = max(experts, shape[0]), min(shape[1], shape[2])  # [E, H, I] or [E, I, H]
    return experts, inter


def read_model_info(model_dir: str | os.PathLike[str]) -> ModelInfo:
    """The experts' shape facts from ``model_dir/config.json``. Raises CheckpointError (what
    is missing or wrong, naming the file) for a missing or unreadable config or one that is not
    a Mixture-of-Experts model's."""
    path = pathlib.Path(model_dir) / "config.json"
    cfg, text, num_experts, inter = _moe_config(path)
    dtype_name = text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    name = str(dtype_name).replace("torch.", "")
    if not _is_dtype(name):
        raise CheckpointError(f"{path}: unknown dtype {dtype_name!r}")
    try:
        return ModelInfo(
            model_type=str(text.get("model_type", cfg.get("model_type", ""))),
            num_layers=int(text["num_hidden_layers"]),
            num_experts=int(num_experts),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(inter),
            hidden_act=str(text.get("hidden_act", "silu")),
            dtype_name=name,
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: a size is not a number: {exc}") from exc


# torch's dtypes by name, for where torch is not installed (a worker that computes with numpy).
_DTYPE_NAMES = frozenset({"float32", "float", "float16", "half", "bfloat16", "float64", "double", "float8_e4m3fn",
                          "float8_e5m2", "uint8", "int8", "int16", "int32", "int64"})


def _is_dtype(name: str) -> bool:
    """Whether ``name`` is one of torch's dtypes: asked of torch where it is installed (as
    always), else of the names above; torch is imported here, not at import: a command checks
    its --model before torch loads."""
    from kvasir_rpc._np_kernel import torch_installed

    if not torch_installed():
        return name in _DTYPE_NAMES
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


#: What to do about a folder check_checkpoint refuses; callers put their flag's name before it.
CHECKPOINT_HINT = ("point --model at a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer); "
                   "`kvasir model tiny DIR` makes a small one")

# Any one of these lets transformers' AutoTokenizer load without sentencepiece or a download.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_checkpoint(model_dir: str | os.PathLike[str], *, tokenizer: bool = True) -> ModelInfo:
    """Check, from file names and ``config.json`` alone (no weights read, nothing imported),
    that ``model_dir`` is a checkpoint folder this project can load: a folder with a
    Mixture-of-Experts ``config.json`` (see read_model_info), safetensors weights and, with
    ``tokenizer`` (the backbone's case; a worker needs none), a tokenizer file.

    Returns its ModelInfo. Raises CheckpointError saying what is missing; its message names
    the folder, not the flag (callers add theirs and CHECKPOINT_HINT)."""
    path = pathlib.Path(model_dir)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint folder")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json")
    cfg, text, _, _ = _moe_config(path / "config.json")
    if not text.get("model_type", cfg.get("model_type")):
        raise CheckpointError(f"{path / 'config.json'} names no model_type")
    if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("*.safetensors")):
        bins = any(path.glob("*.bin"))
        raise CheckpointError(f"{path} has no *.safetensors weights"
                              + (" (PyTorch *.bin files are not read: convert them to safetensors)" if bins else ""))
    if tokenizer and not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise CheckpointError(f"{path} has no tokenizer ({' or '.join(_TOKENIZER_FILES[:2])})")
    if tokenizer and (path / ".kvasir-fetch.json").exists():
        # A worker's fetch of its slices (python -m worker --model URL): every other byte of its
        # shards is a hole that reads as zeros, the dense part included.
        raise CheckpointError(f"{path} is a worker's fetched slices (.kvasir-fetch.json): it holds only those "
                              "experts' bytes, the rest reads as zeros; point at the whole checkpoint")
    return read_model_info(path)


@dataclasses.dataclass(frozen=True)
class _Loc:
    file: pathlib.Path
    key: str
    index: int | None  # row of a fused [E, ...] tensor, None for a per-expert tensor


@dataclasses.dataclass(frozen=True)
class _Span:
    """Where one tensor's bytes are in its safetensors file."""

    start: int  # absolute byte offset
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


# safetensors' dtype names for what expert weights come in; a tensor of another dtype is read
# (load), not mapped.
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_HEADER_MAX = 100 << 20  # the safetensors library's own limit on a header


def _read_spans(file: pathlib.Path) -> dict[str, _Span]:
    """The spans of the mappable tensors of one safetensors file, from its header (8 bytes of
    little-endian length, then JSON): only entries whose offsets, shape and dtype agree, so a
    damaged or unusual header leaves a tensor to ``safe_open``, which says what is wrong."""
    import torch

    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            return {}
        n = int.from_bytes(head, "little")
        if n > _HEADER_MAX:
            return {}
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return {}
    size = file.stat().st_size
    spans: dict[str, _Span] = {}
    if not isinstance(header, dict):
        return spans
    for key, meta in header.items():
        try:
            dtype = getattr(torch, _SAFETENSORS_DTYPES[meta["dtype"]])
            shape = tuple(int(d) for d in meta["shape"])
            a, b = (8 + n + int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            continue
        count = math.prod(shape)
        if count and b - a == count * dtype.itemsize and 8 + n <= a and b <= size:
            spans[key] = _Span(a, b, dtype, shape)
    return spans


def _map_tensor(file: pathlib.Path, start: int, end: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Bytes ``[start, end)`` of ``file`` as a tensor, not read but mapped: a private
    (copy-on-write, so never written back) mapping of just those pages, unmapped when the
    tensor and its views are gone."""
    import torch

    page = mmap.ALLOCATIONGRANULARITY
    offset = start - start % page
    with open(file, "rb") as f:
        if os.fstat(f.fileno()).st_size < end:  # shorter than its header said: shrunk since
            raise CheckpointError(f"{file} is shorter than its header says; was it changed while in use?")
        m = mmap.mmap(f.fileno(), end - offset, access=mmap.ACCESS_COPY, offset=offset)
    return torch.frombuffer(m, dtype=dtype, offset=start - offset, count=(end - start) // dtype.itemsize).view(*shape)


class ExpertIndex:
    """Where each (layer, expert)'s gate, up and down weights live in a checkpoint.

    Opening reads only the safetensors headers. ``load(layer, expert)`` reads that expert's
    bytes and returns ``(gate_up [2I, H], down [H, I])`` as the fused form transformers uses;
    ``view(layer, expert)`` returns the same tensors mapped from the files rather than read.
    Both keep the checkpoint's orientation (``[H, 2I]`` and ``[I, H]`` where it stores them
    transposed); ``function`` says how an expert computes with them, and ``biases`` gives
    an expert's biases where it has them.
    """

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        self.model_dir = pathlib.Path(model_dir)
        self.info = read_model_info(self.model_dir)
        self._bias_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._locs: dict[tuple[int, int], dict[str, _Loc]] = {}
        self._others: dict[str, pathlib.Path] = {}
        self._spans: dict[pathlib.Path, dict[str, _Span]] = {}  # by file, read when first mapped
        for file, keys in self._files_and_keys():
            for key in keys:
                if m := _PER_EXPERT.match(key):
                    slot = self._locs.setdefault((int(m["layer"]), int(m["expert"])), {})
                    slot[_PROJ[m["proj"]] + _KIND[m["kind"]]] = _Loc(file, key, None)
                elif m := _FUSED.match(key):
                    layer, proj = int(m["layer"]), _fused_proj(m)
                    for e in range(self.info.num_experts):
                        slot = self._locs.setdefault((layer, e), {})
                        slot[proj] = _Loc(file, key, e)
                else:
                    self._others[key] = file
        forms = ({"gate", "up", "down"}, {"gate_up_proj", "down_proj"},
                 {"gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"},
                 {"gate_packed", "up_packed", "down_packed"})
        incomplete = [k for k, v in self._locs.items() if not any(f <= v.keys() for f in forms)]
        if incomplete:
            raise CheckpointError(f"{self.model_dir}: experts with missing projections: {sorted(incomplete)[:8]}")
        if not self._locs:
            raise CheckpointError(f"{self.model_dir}: no expert tensors found in the safetensors files")
        scaled = [("gate_scale" in v, "up_scale" in v, "down_scale" in v) for v in self._locs.values()]
        # How the experts are quantized: "fp8" (block FP8, weight_scale_inv beside each weight),
        # "mxfp4" (gpt-oss's *_blocks and *_scales), "ct-fp8" or "ct-int" (compressed-tensors:
        # self.ct says how), or None.
        self.quant: str | None = None
        self.ct: CtScheme | None = None
        quantization = self.quantization_config()
        if quantization.get("quant_method") == "compressed-tensors":
            self.ct = self._read_ct(quantization)
            self.quant = self.ct.kind
        elif any(any(t) for t in scaled):
            if not all(all(t) for t in scaled):
                raise CheckpointError(f"{self.model_dir}: some expert weights have FP8 scales (weight_scale_inv) and "
                                      "some do not")
            self.quant = "fp8"
        elif any("gate_up_proj_blocks" in v for v in self._locs.values()):
            if not all(forms[2] <= v.keys() for v in self._locs.values()):
                raise CheckpointError(f"{self.model_dir}: some experts are in MXFP4 (*_blocks, *_scales) and some not")
            self.quant = "mxfp4"
        self.quantized = self.quant is not None
        self.function = self._read_function()

    def quantization_config(self) -> dict[str, Any]:
        """The config's ``quantization_config`` ({} when there is none)."""
        cfg, text, _, _ = _moe_config(self.model_dir / "config.json")
        found = cfg.get("quantization_config") or text.get("quantization_config") or {}
        return found if isinstance(found, dict) else {}

    def _read_ct(self, quantization: dict[str, Any]) -> CtScheme:
        """A compressed-tensors checkpoint's experts scheme, checked against the tensors: each
        expert has every tensor its kind needs (``CT_TENSORS``) and none it cannot use (zero
        points, activation orders). Raises CheckpointError, saying what is served."""
        from kvasir_rpc._quant import CT_TENSORS, ct_experts_scheme

        try:
            ct = ct_experts_scheme(quantization)
        except ImportError as exc:
            raise CheckpointError(f"{self.model_dir}: a compressed-tensors checkpoint needs the compressed-tensors "
                                  f"package ({exc}); reinstall kvasir-rpc") from None
        except ValueError as exc:
            raise CheckpointError(f"{self.model_dir / 'config.json'}: {exc}") from None
        suffixes = {_KIND[name] for name in CT_TENSORS[ct.kind]}
        needed = {proj + suffix for proj in ("gate", "up", "down") for suffix in suffixes}
        for key, slot in sorted(self._locs.items()):
            if not needed <= slot.keys():
                raise CheckpointError(f"{self.model_dir}: expert {key} lacks {sorted(needed - slot.keys())} for "
                                      f"{ct.describe()} (is it per-expert, as compressed-tensors stores it?)")
            extra = sorted(k for k in slot if k.endswith(("_zero_point", "_g_idx")))
            if extra:
                raise CheckpointError(f"{self.model_dir}: expert {key} has {extra}: zero points and activation "
                                      f"orders are not served ({ct.describe()} expected)")
        return ct

    def _read_function(self) -> ExpertFunction:
        """The expert function, from the config and the expert tensors (docs/PROTOCOL.md
        §11.2): biases when the checkpoint has them, transposed when the fused tensors' shapes
        are [E, H, 2I] / [E, I, H] (H and I from the config; per-expert tensors are [out, in])."""
        from kvasir_rpc._function import ExpertFunction

        slot = next(iter(self._locs.values()))
        has_bias = {"gate_up_proj_bias", "down_proj_bias"} <= slot.keys()
        if any(("gate_up_proj_bias" in v) != has_bias for v in self._locs.values()):
            raise CheckpointError(f"{self.model_dir}: some experts have biases and some do not")
        transposed = self.quant == "mxfp4"  # dequantized to [in, out], as gpt-oss's experts hold them
        if "gate_up_proj" in slot:
            hidden, inter = self.info.hidden_size, self.info.intermediate_size
            gu, down = self._shape(slot["gate_up_proj"]), self._shape(slot["down_proj"])
            if gu is not None and down is not None:
                stored = ([hidden, 2 * inter], [inter, hidden])
                plain = ([2 * inter, hidden], [hidden, inter])
                if (gu[1:], down[1:]) == stored:
                    transposed = True
                elif (gu[1:], down[1:]) != plain:
                    raise CheckpointError(
                        f"{self.model_dir}: fused expert tensors of shapes {gu} and {down} fit neither "
                        f"[E, 2I, H] / [E, H, I] nor [E, H, 2I] / [E, I, H] with hidden_size {hidden} and "
                        f"intermediate size {inter}")
        _, text, _, _ = _moe_config(self.model_dir / "config.json")
        try:
            return ExpertFunction.from_config(text, transposed=transposed, bias=has_bias)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{self.model_dir / 'config.json'}: {exc}") from None

    def _files_and_keys(self) -> Iterable[tuple[pathlib.Path, list[str]]]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            by_file: dict[str, list[str]] = {}
            for key, fname in weight_map.items():
                by_file.setdefault(fname, []).append(key)
            for fname, keys in sorted(by_file.items()):
                yield self.model_dir / fname, sorted(keys)
            return
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.model_dir}: no *.safetensors files")
        for f in files:
            with safe_open(str(f), framework="numpy") as h:  # keys only: no torch needed
                yield f, sorted(h.keys())

    @property
    def slices(self) -> dict[int, tuple[int, ...]]:
        """Every (layer, expert) in the checkpoint, as {layer: experts}."""
        out: dict[int, list[int]] = {}
        for layer, expert in sorted(self._locs):
            out.setdefault(layer, []).append(expert)
        return {k: tuple(v) for k, v in out.items()}

    def other_tensors(self) -> dict[str, pathlib.Path]:
        """Every tensor of the checkpoint that holds no routed expert (the dense part), by
        name, with the safetensors file it is in."""
        return dict(self._others)

    def has(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._locs

    def _read(self, loc: _Loc) -> torch.Tensor:
        with safe_open(str(loc.file), framework="pt") as h:
            if loc.index is None:
                return h.get_tensor(loc.key)
            return h.get_slice(loc.key)[loc.index]

    def _shape(self, loc: _Loc) -> list[int] | None:
        """The whole stored tensor's shape at ``loc`` (a fused one's [E, ...]), from its file's
        header alone; None where the header does not say."""
        try:
            with safe_open(str(loc.file), framework="numpy") as h:  # the header only: no torch needed
                return list(h.get_slice(loc.key).get_shape())
        except (OSError, SafetensorError):  # a missing or damaged file: the reads say what is wrong
            return None

    def biases(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(gate_up_bias [2I], down_bias [H])`` of one expert (read once, then kept: they are
        tiny), or None when the experts have no biases. Raises KeyError if absent."""
        slot = self._locs[(layer, expert)]
        if "gate_up_proj_bias" not in slot:
            return None
        held = self._bias_cache.get((layer, expert))
        if held is None:
            from kvasir_rpc._kernel import _aligned

            held = self._bias_cache[(layer, expert)] = (
                _aligned(self._read(slot["gate_up_proj_bias"]).contiguous()),
                _aligned(self._read(slot["down_proj_bias"]).contiguous()))
        return held

    def load(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read one expert: ``(gate_up [2I, H], down [H, I])``, contiguous and starting on a
        64-byte boundary. Raises KeyError if absent.

        safetensors hands out tensors over a bytes object, whose payload sits 32 bytes into
        it: read as it is, a weight would be misaligned and ``expert_forward`` would copy
        all of it on every call (see ``_aligned`` in ``_kernel``), 6 MiB per call for one of
        Qwen3-30B-A3B's down projections."""
        from kvasir_rpc._kernel import _aligned

        slot = self._locs[(layer, expert)]
        if self.quantized:
            return self.load_quantized(layer, expert).dequantize()
        if "gate_up_proj" in slot:
            return (_aligned(self._read(slot["gate_up_proj"]).contiguous()),
                    _aligned(self._read(slot["down_proj"]).contiguous()))
        gate, up, down = (self._read(slot[p]) for p in ("gate", "up", "down"))
        import torch

        return torch.cat([gate, up], dim=0).contiguous(), _aligned(down.contiguous())

    def load_quantized(self, layer: int, expert: int) -> QuantizedWeights:
        """One expert of a quantized checkpoint as stored (block FP8: its FP8 weights and scales,
        about half its bfloat16 size; MXFP4: its blocks and scales, about a quarter), to
        dequantize when computing. Raises KeyError if absent, CheckpointError when the
        checkpoint is not quantized."""
        from kvasir_rpc._quant import CT_TENSORS, CtExpert, Mxfp4Expert, QuantizedExpert

        if not self.quantized:
            raise CheckpointError(f"{self.model_dir}: not a quantized checkpoint")
        slot = self._locs[(layer, expert)]
        if self.ct is not None:
            names = CT_TENSORS[self.ct.kind]
            parts = {p: {n: self._read(slot[p + _KIND[n]]).contiguous() for n in names} for p in ("gate", "up", "down")}
            return CtExpert(self.ct.kind, self.ct.scheme, parts, dtype=self.info.dtype)
        if self.quant == "mxfp4":
            m = {p: self._read(slot[p]).contiguous() for p in ("gate_up_proj_blocks", "gate_up_proj_scales",
                                                                "down_proj_blocks", "down_proj_scales")}
            return Mxfp4Expert(m["gate_up_proj_blocks"], m["gate_up_proj_scales"], m["down_proj_blocks"],
                               m["down_proj_scales"], dtype=self.info.dtype)
        t = {p: self._read(slot[p]).contiguous() for p in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale")}
        return QuantizedExpert(t["gate"], t["up"], t["down"], t["gate_scale"], t["up_scale"], t["down_scale"],
                               dtype=self.info.dtype)

    def view(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``load`` returns, equal bit for bit, without reading the bytes: each tensor maps
        its span of the file, and the mapping lasts as long as the tensor (and its views) do,
        so nothing stays in memory after. The fused form's slice of one expert maps as it is,
        and so do separate gate and up stored back to back (what sorted keys give
        ``gate_proj``/``up_proj``); other gate/up pairs are joined, one copy, and a tensor
        this cannot map (another dtype, a big-endian machine) is read as ``load`` reads it.

        For reads that are used once (audits): an expert ``load``-ed costs a read of its bytes
        into memory and, stored as separate tensors, a second copy to join gate and up; mapped,
        the kernel reads the page cache in place. A file must not be truncated while a
        mapping of it is in use (the process would get SIGBUS); replace checkpoints by rename."""
        slot = self._locs[(layer, expert)]
        if sys.byteorder != "little" or self.quantized:  # FP8 weights are dequantized, not mapped
            return self.load(layer, expert)
        if "gate_up_proj" in slot:
            fused_gu, fused_down = (self._map_slice(slot[p]) for p in ("gate_up_proj", "down_proj"))
            if fused_gu is None or fused_down is None:
                return self.load(layer, expert)
            return fused_gu, fused_down
        gate, up, down = (slot[p] for p in ("gate", "up", "down"))
        sg, su, sd = (self._span(loc) for loc in (gate, up, down))
        if sg is None or su is None or sd is None:
            return self.load(layer, expert)
        down_t = _map_tensor(down.file, sd.start, sd.end, sd.dtype, sd.shape)
        if (gate.file == up.file and sg.end == su.start and sg.dtype == su.dtype and len(sg.shape) == len(su.shape) == 2
                and sg.shape[1] == su.shape[1]):
            return _map_tensor(gate.file, sg.start, su.end, sg.dtype, (sg.shape[0] + su.shape[0], sg.shape[1])), down_t
        import torch

        parts = [_map_tensor(loc.file, s.start, s.end, s.dtype, s.shape) for loc, s in ((gate, sg), (up, su))]
        return torch.cat(parts, dim=0), down_t

    def _span(self, loc: _Loc) -> _Span | None:
        spans = self._spans.get(loc.file)
        if spans is None:  # two threads may both read it; either result is the same
            spans = self._spans[loc.file] = _read_spans(loc.file)
        return spans.get(loc.key)

    def _map_slice(self, loc: _Loc) -> torch.Tensor | None:
        """Row ``loc.index`` of a fused [E, ...] tensor, mapped; None where it cannot be."""
        span = self._span(loc)
        if span is None or loc.index is None or not span.shape or not 0 <= loc.index < span.shape[0]:
            return None
        per = (span.end - span.start) // span.shape[0]
        start = span.start + loc.index * per
        return _map_tensor(loc.file, start, start + per, span.dtype, span.shape[1:])

    def expert_digest(self, layer: int, expert: int) -> bytes:
        """sha256 of one expert's weights in the fused form, with dtype and shapes (and its
        biases after them, where it has them)."""
        gate_up, down = self.view(layer, expert)
        return expert_digest(gate_up, down, *(self.biases(layer, expert) or ()))


def expert_digest(*tensors: torch.Tensor) -> bytes:
    """sha256 over dtype, shapes and raw bytes of ``(gate_up, down[, gate_up_bias,
    down_bias])``; the same bytes digest the same wherever they are loaded."""
    import torch

    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str(t.dtype).encode() + b"\x00" + struct.pack(f"<{t.dim()}Q", *t.shape))
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # hashed in place, not copied to bytes first
    return h.digest()


def slices_digest(expert_digests: Mapping[tuple[int, int], bytes]) -> bytes:
    """Combine per-expert digests into the one digest a worker announces."""
    h = hashlib.sha256(WEIGHTS_DIGEST_DOMAIN)
    for (layer, expert), d in sorted(expert_digests.items()):
        h.update(struct.pack("<II", layer, expert) + d)
    return h.digest()


def _parse_range(text: str, limit: int, what: str) -> range:
    text = text.strip()
    if text == "*":
        return range(limit)
    m = re.fullmatch(r"([0-9]{1,9})(?:-([0-9]{1,9}))?", text)
    if not m:
        raise SpecError(f"{what} {text!r}: expected N, N-M or *")
    lo = int(m[1])
    hi = int(m[2]) if m[2] is not None else lo
    if lo > hi:
        raise SpecError(f"{what} range {text!r} is empty")
    if hi >= limit:
        raise SpecError(f"{what} {hi} out of range: the model has {limit} ({what}s 0-{limit - 1})")
    return range(lo, hi + 1)


def parse_expert_spec(spec: str, num_layers: int, num_experts: int) -> dict[int, tuple[int, ...]]:
    """Parse a SPEC: comma-separated items, each ``all`` or ``LAYERS:EXPERTS`` where each side
    is ``N``, ``N-M`` (inclusive) or ``*``. Returns {layer: sorted experts}.

    ``all``, ``0-3:0-15``, ``*:0-7``, ``0:1,2:3-4``. Raises SpecError with the reason.
    """
    out: dict[int, set[int]] = {}
    items = [s for s in spec.split(",") if s.strip()]
    if not items:
        raise SpecError("empty expert SPEC; use e.g. 'all', '*:0-7' or '0-3:0-15'")
    for item in items:
        item = item.strip()
        if item == "all":
            layers, experts = range(num_layers), range(num_experts)
        else:
            if item.count(":") != 1:
                raise SpecError(f"SPEC item {item!r}: expected LAYERS:EXPERTS or 'all'")
            lpart, epart = item.split(":")
            layers = _parse_range(lpart, num_layers, "layer")
            experts = _parse_range(epart, num_experts, "expert")
        for layer in layers:
            out.setdefault(layer, set()).update(experts)
    return {k: tuple(sorted(v)) for k, v in sorted(out.items())}


def format_slices(slices: Mapping[int, Sequence[int]]) -> str:
    """Compact human form, e.g. ``0:0-3,1:0-3`` (the inverse of parse_expert_spec)."""
    parts: list[str] = []
    for layer, experts in sorted(slices.items()):
        runs: list[str] = []
        exp = sorted(experts)
        i = 0
        while i < len(exp):
            j = i
            while j + 1 < len(exp) and exp[j + 1] == exp[j] + 1:
                j += 1
            runs.append(str(exp[i]) if i == j else f"{exp[i]}-{exp[j]}")
            i = j + 1
        parts.extend(f"{layer}:{r}" for r in runs)
    return ",".join(parts)
