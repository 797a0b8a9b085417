"""Where an expert's weights come from, and loading a model without its experts.

``HeldWeights``: the experts the model holds, as transformers loaded them (every expert is
in memory). ``CheckpointWeights``: the model's experts were never loaded (their parameters
are on the meta device, see ``load_without_experts``); an expert is read from the
checkpoint the first time this backbone computes it, so resident memory is the dense part
plus the experts computed here.
"""

from __future__ import annotations

import os
import pathlib
import re
import threading

import torch

from kvasir_rpc import ExpertIndex, expert_digest, function_of_module, get_logger

__all__ = ["CheckpointWeights", "ExpertTensors", "ExpertWeights", "HeldWeights", "experts_modules",
           "load_without_experts"]

# One expert's (gate_up, down, biases) as stored: biases (gate_up_bias, down_bias) or None.
ExpertTensors = tuple[torch.Tensor, torch.Tensor, "tuple[torch.Tensor, torch.Tensor] | None"]

log = get_logger("backbone.weights")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a module name sits in (``model.layers.3.mlp`` -> 3), or None."""
    m = _LAYER.search(name + ".")
    return int(m[1]) if m else None


def experts_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """{layer: experts module}: every module of a decoder layer whose class transformers'
    ``use_experts_implementation`` declared (it gives each the traits ``has_gate``,
    ``is_concatenated``...): the experts that go through ``ExpertsInterface``. Raises
    ValueError when there are none, or when their declared function is not one this project
    computes (``function_of_module``), naming what is missing."""
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        layer = layer_of(name)
        if layer is not None and hasattr(module, "has_gate") and hasattr(module, "is_concatenated"):
            found[layer] = module
    if not found:
        raise ValueError("the model has no experts modules declared with transformers' use_experts_implementation "
                         "(no Mixture-of-Experts layers this project can serve)")
    for module in found.values():
        function_of_module(module)
    return found


def _fused(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] of an experts module."""
    gate_up, down = module.gate_up_proj, module.down_proj
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    return gate_up, down


class ExpertWeights:
    """One expert's ``(gate_up [2I, H], down [H, I])`` for the experts of ``modules``."""

    def __init__(self, modules: dict[int, torch.nn.Module]) -> None:
        self.modules = modules
        # What each MoE layer's experts compute (what a worker must announce to be used).
        self.functions = {layer: function_of_module(m) for layer, m in modules.items()}

    def layers(self) -> list[int]:
        """The MoE layers, ascending."""
        return sorted(self.modules)

    def num_experts(self, layer: int) -> int | None:
        """Experts in ``layer``, or None when the layer has none."""
        module = self.modules.get(layer)
        return None if module is None else int(_fused(module)[0].shape[0])

    def intermediate_size(self, layer: int) -> int:
        """The experts' intermediate width in ``layer`` (I, of down [E, H, I] or, transposed, [E, I, H])."""
        module = self.modules[layer]
        down = _fused(module)[1]
        return int(down.shape[1] if getattr(module, "is_transposed", False) else down.shape[-1])

    def get(self, layer: int, expert: int, *, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``keep=False`` (audits, which touch a sampled few): do not grow memory for it."""
        raise NotImplementedError

    def biases(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(gate_up_bias [2I], down_bias [H])``, or None for experts without biases."""
        raise NotImplementedError

    def digest(self, layer: int, expert: int) -> bytes:
        """The expert's weights digest (what a worker holding it announces)."""
        raise NotImplementedError

    def bytes_held(self) -> int:
        """Bytes of expert weights this process holds in memory."""
        raise NotImplementedError


class HeldWeights(ExpertWeights):
    """Every expert as the model holds it."""

    def get(self, layer: int, expert: int, *, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = _fused(self.modules[layer])
        return gate_up[expert], down[expert]

    def biases(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        module = self.modules[layer]
        if not getattr(module, "has_bias", False):
            return None
        gate_up_bias, down_bias = module.gate_up_proj_bias, module.down_proj_bias
        assert isinstance(gate_up_bias, torch.Tensor) and isinstance(down_bias, torch.Tensor)
        return gate_up_bias[expert], down_bias[expert]

    def digest(self, layer: int, expert: int) -> bytes:
        return expert_digest(*self.get(layer, expert), *(self.biases(layer, expert) or ()))

    def bytes_held(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in _fused(m))


class CheckpointWeights(ExpertWeights):
    """Experts read from the checkpoint when first computed here, then kept."""

    def __init__(self, modules: dict[int, torch.nn.Module], index: ExpertIndex) -> None:
        super().__init__(modules)
        self.index = index
        self._loaded: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, layer: int, expert: int, *, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, expert)
        with self._lock:
            held = self._loaded.get(key)
            if held is not None:
                return held
            if keep:
                held = self._loaded[key] = self.index.load(layer, expert)
                return held
        # For an audit, not kept: mapped rather than read (no copy of its bytes, and nothing
        # left in memory once the audit drops it), outside the lock, so the decode threads
        # that compute experts here are not held up by the audit thread.
        return self.index.view(layer, expert)

    def biases(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.index.biases(layer, expert)

    def digest(self, layer: int, expert: int) -> bytes:
        return self.index.expert_digest(layer, expert)

    def bytes_held(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for pair in self._loaded.values() for t in pair)


def load_without_experts(model_dir: str | os.PathLike[str], index: ExpertIndex | None = None):  # type: ignore[no-untyped-def]
    """The checkpoint's model with its dense part loaded and its routed experts left on the
    meta device: expert bytes are never read nor allocated, not even while loading.

    The model is built on the meta device by transformers (the same classes and config as
    ``from_pretrained``); the checkpoint's other tensors are renamed as transformers renames
    them, read one by one and assigned in place (``load_state_dict(assign=True)``); what
    transformers computes rather than loads (rotary tables) is initialised by its own
    ``initialize_weights``, which leaves every loaded tensor as it is.

    Raises CheckpointError (a ValueError) when the checkpoint lacks a dense tensor the model
    needs, holds one of another shape, or holds a dense tensor that transformers would have to
    convert rather than rename (load such a checkpoint with every expert instead)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from kvasir_rpc import (
        CT_COMPANIONS,
        CheckpointError,
        dequantize_block_fp8,
        dequantize_ct_dense,
        quantize_ct_activations,
    )

    model_dir = pathlib.Path(model_dir)
    index = index if index is not None else ExpertIndex(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = {id(p) for m in experts_modules(model).values() for p in m.parameters()}
    wanted = {k: v for k, v in model.state_dict(keep_vars=True).items() if id(v) not in experts}

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_file: dict[pathlib.Path, dict[str, str]] = {}
    ct_modules: dict[str, dict[str, tuple[pathlib.Path, str]]] = {}
    unexpected: list[str] = []
    others = index.other_tensors()
    # A block-FP8 release keeps each quantized weight's scales beside it: the weight is
    # dequantized as transformers' from_pretrained does (the same formula, the same bits).
    scales = {name[: -len("_scale_inv")]: (file, name) for name, file in others.items()
              if name.endswith(".weight_scale_inv")}
    # A compressed-tensors release keeps a module's weight_scale (and, packed, weight_packed and
    # weight_shape) beside or instead of its weight: dequantized by compressed-tensors' own
    # decompressor, as transformers does. {the module's weight name: {local name: (file, name)}}
    ct_config = index.quantization_config() if index.ct is not None else None
    compressed: dict[str, dict[str, tuple[pathlib.Path, str]]] = {}
    if ct_config is not None:
        for name, file in others.items():
            module, _, leaf = name.rpartition(".")
            if leaf in CT_COMPANIONS or (leaf == "weight" and module + ".weight_scale" in others):
                compressed.setdefault(module + ".weight", {})[leaf] = (file, name)
    for name, file in sorted(others.items()):
        if name.endswith(".weight_scale_inv"):
            continue
        if name in compressed or (name.rpartition(".")[0] + ".weight") in compressed:
            if name.endswith(".weight_scale"):  # one entry per module: its scale's
                target, _ = rename_source_key(name[: -len("_scale")], renamings, converters,
                                              model.base_model_prefix, wanted)
                if target in wanted:
                    ct_modules[target] = compressed[name[: -len("_scale")]]
                else:
                    unexpected.append(name)
            continue
        target, converter = rename_source_key(name, renamings, converters, model.base_model_prefix, wanted)
        if converter is not None:
            raise CheckpointError(f"{model_dir}: tensor {name} must be converted ({converter}) to load, not only "
                                  "renamed; load this checkpoint with every expert (--expert-weights all)")
        if target in wanted:
            by_file.setdefault(file, {})[name] = target
        else:
            unexpected.append(name)

    state: dict[str, torch.Tensor] = {}
    mismatched: list[str] = []
    for target, parts in sorted(ct_modules.items()):
        assert ct_config is not None
        tensors = {}
        for leaf, (file, name) in parts.items():
            with safe_open(str(file), framework="pt") as h:
                tensors[leaf] = h.get_tensor(name)
        like = wanted[target]
        try:
            weight = dequantize_ct_dense(ct_config, tensors, like.dtype)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{model_dir}: {target} cannot be decompressed ({type(exc).__name__}: {exc}); load "
                                  "this checkpoint with every expert (--expert-weights all)") from None
        if weight.shape != like.shape:
            mismatched.append(f"{target}: {list(weight.shape)} decompressed, {list(like.shape)} in the model")
        else:
            state[target] = weight
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt") as h:
            for name, target in names.items():
                tensor = h.get_tensor(name)
                like = wanted[target]
                if tensor.shape != like.shape:
                    mismatched.append(f"{name}: {list(tensor.shape)} in the checkpoint, {list(like.shape)} in the model")
                    continue
                if name in scales:
                    scale_file, scale_name = scales[name]
                    if scale_file == file:  # the releases keep a weight's scales in its shard
                        scale = h.get_tensor(scale_name)
                    else:
                        with safe_open(str(scale_file), framework="pt") as hs:
                            scale = hs.get_tensor(scale_name)
                    state[target] = dequantize_block_fp8(tensor, scale, like.dtype)
                elif tensor.dtype == torch.float8_e4m3fn:
                    raise CheckpointError(f"{model_dir}: {name} is stored in FP8 without its {name}_scale_inv")
                else:
                    state[target] = tensor.to(like.dtype)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    persistent = set(model.state_dict().keys())
    missing = sorted(k for k in wanted if k in persistent and k not in state and k not in tied)
    if missing or mismatched:
        raise CheckpointError(f"{model_dir}: the dense part does not fit the model: missing {missing[:8]} "
                              f"({len(missing)}), mismatched {mismatched[:8]} ({len(mismatched)})")
    if unexpected:
        log.warning("checkpoint tensors this model does not use; not read", count=len(unexpected),
                    first=unexpected[:4])

    model.load_state_dict(state, strict=False, assign=True)
    # What transformers computes instead of loading (non-persistent buffers such as the rotary
    # tables) is still on meta: give it memory and let transformers initialise it. Every
    # loaded tensor is marked initialised, so initialize_weights leaves it alone.
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            persistent_buffer = leaf not in module._non_persistent_buffers_set
            module.register_buffer(leaf, torch.empty_like(buffer, device="cpu"), persistent=persistent_buffer)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in state:
            tensor._is_hf_initialized = True
    model.initialize_weights()
    model.tie_weights()
    if ct_config is not None:  # FP8_DYNAMIC's per-token FP8 inputs to the dense layers, as transformers runs them
        try:
            quantize_ct_activations(model, ct_config)
        except ValueError as exc:
            raise CheckpointError(f"{model_dir}: {exc}") from None
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(model_dir), local_files_only=True)
    except OSError:
        pass  # no generation_config.json: the model's defaults, as from_pretrained
    model.eval()
    return model
