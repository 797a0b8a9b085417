"""Tiny checkpoints of the Mixture-of-Experts families transformers ships, made by transformers.

:func:`moe_model_types` lists, from the installed transformers itself, the model types whose
modeling code declares its experts through ``use_experts_implementation`` (so they go through
``ExpertsInterface``, the path this project plugs into) and that have a causal-LM class.
:func:`make_family_checkpoint` writes one of them as a user would get it: transformers' own
config for the type (``AutoConfig.for_model``) shrunk to test sizes, a model built from it with
random weights (``AutoModelForCausalLM.from_config``) and saved with ``save_pretrained``,
sharded as releases are, with the tiny tokenizer of ``kvasir.tiny``.

Importing this module is cheap: transformers and torch are imported inside the functions.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

__all__ = ["moe_model_types", "make_family_checkpoint"]

# Test sizes, set where a config has the attribute (through its attribute_map, transformers'
# own aliases: n_routed_experts and moe_num_experts answer to num_local_experts / num_experts).
_SIZES: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
    "vocab_size": 512, "max_position_embeddings": 512, "num_experts_per_tok": 2,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "tie_word_embeddings": False,
}
_EXPERTS = 8
_EXPERT_COUNTS = ("num_experts", "num_local_experts")
_PAD_ID, _BOS_ID, _EOS_ID = 0, 1, 2


def moe_model_types() -> list[str]:
    """Model types of the installed transformers that have a causal-LM class and whose
    modeling module declares experts with ``use_experts_implementation``, sorted."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = pathlib.Path(transformers.__file__).parent / "models"
    declared = {p.parent.name for p in root.glob("*/modeling_*.py") if "@use_experts_implementation" in p.read_text()}
    return sorted(t for t in CONFIG_MAPPING_NAMES
                  if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type_to_module_name(t) in declared)


def _shrink(config: Any) -> Any:
    """``config`` at test sizes (in place), its text config too when it has one."""
    targets = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        targets.append(text)
    for c in targets:
        for name, value in _SIZES.items():
            if hasattr(c, name):
                setattr(c, name, value)
        for name in _EXPERT_COUNTS:
            if hasattr(c, name):
                setattr(c, name, _EXPERTS)
        layers = getattr(c, "num_hidden_layers", None)
        kinds = getattr(c, "layer_types", None)
        if isinstance(kinds, list) and layers:
            setattr(c, "layer_types", (kinds * layers)[:layers])
        kinds = getattr(c, "mlp_layer_types", None)
        if isinstance(kinds, list) and kinds and layers:
            # Releases start with layers of another kind (DeepSeek-V3.2's first three dense,
            # DeepSeek-V4's first three hash-routed): at test sizes the first layer of that kind,
            # then the kind most of the model has, so that it has routed experts at all.
            setattr(c, "mlp_layer_types", [kinds[0]] + [kinds[-1]] * (layers - 1))
        if isinstance(getattr(c, "mlp_only_layers", None), list):
            c.mlp_only_layers = []
        if getattr(c, "decoder_sparse_step", None):
            c.decoder_sparse_step = 1
        for name, value in (("pad_token_id", _PAD_ID), ("bos_token_id", _BOS_ID), ("eos_token_id", _EOS_ID)):
            if hasattr(c, name):
                setattr(c, name, value)
    return config


def make_family_checkpoint(directory: str | pathlib.Path, model_type: str, *, dtype: str = "float32",
                           seed: int = 0, shard: str = "200KB", quant: str | None = None,
                           block: int = 128, group_size: int = 32) -> pathlib.Path:
    """Write a tiny random checkpoint of ``model_type`` with transformers' ``save_pretrained``
    (``dtype`` float32, bfloat16 or float16; shards of at most ``shard``), and the tiny
    tokenizer. ``quant="fp8"``: then rewritten as a block-FP8 release is laid out
    (``kvasir_rpc._quant.write_fp8_release``, blocks of ``block``); ``"mxfp4"``: as gpt-oss's
    release (``write_mxfp4_release``; fused experts); ``"ct-fp8"`` / ``"ct-int4"``: as
    llm-compressor writes compressed-tensors (``write_ct_release``, int4 groups of
    ``group_size``); the model's dtype bfloat16.
    Returns the folder. Raises ValueError for a type transformers does not know or cannot build
    at these sizes (the message says why)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from kvasir.tiny import _write_tokenizer

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if quant not in (None, "fp8", "mxfp4", "ct-fp8", "ct-int4"):
        raise ValueError(f"quant must be fp8, mxfp4, ct-fp8 or ct-int4 (or none), got {quant!r}")
    if quant is not None and dtype != "bfloat16":
        raise ValueError(f"a {quant} release's model computes in bfloat16: use --dtype bfloat16")
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    try:
        config = _shrink(AutoConfig.for_model(model_type))
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model.generation_config = GenerationConfig(bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, pad_token_id=_PAD_ID,
                                                   do_sample=False)
        model.save_pretrained(str(path), max_shard_size=shard)
    except Exception as exc:  # transformers' own refusal of the config, whatever it raises
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise ValueError(f"transformers cannot build it at the test sizes: {type(exc).__name__}: {first[:200]}") from exc
    _write_tokenizer(path, int(config.get_text_config().vocab_size))
    if quant is not None:
        import shutil
        import tempfile

        from kvasir_rpc import write_ct_release, write_fp8_release, write_mxfp4_release

        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = pathlib.Path(tmp) / "q"
            if quant == "fp8":
                staged = write_fp8_release(path, out, block=block)
            elif quant == "mxfp4":
                staged = write_mxfp4_release(path, out)
            else:
                staged = write_ct_release(path, out, kind=quant[3:], group_size=group_size)
            for old_file in path.glob("*.safetensors"):
                old_file.unlink()
            for f in staged.iterdir():
                shutil.move(str(f), str(path / f.name))
    meta = {"made_by": "kvasir.families", "model_type": model_type, "dtype": dtype, "seed": seed,
            "quant": quant}
    (path / "kvasir_tiny.json").write_text(json.dumps(meta) + "\n")
    return path
