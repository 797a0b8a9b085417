"""Tiny random Mixture-of-Experts checkpoints for tests.

:func:`make_tiny_checkpoint` writes a small, randomly initialised MoE causal
language model in the Hugging Face on-disk layout (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``).  The expert weights are stored *per expert*, under
the tensor names that published checkpoints use, so code that reads
checkpoints by name can be exercised without downloading anything:

========================  ==========================================================
arch                      per-expert / router / shared-expert tensor names
========================  ==========================================================
``qwen3_moe``             ``model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight``,
                          ``model.layers.{L}.mlp.gate.weight``
``qwen3_5_moe``           ``model.language_model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight``,
                          ``model.language_model.layers.{L}.mlp.gate.weight``,
                          ``model.language_model.layers.{L}.mlp.shared_expert.{gate,up,down}_proj.weight``,
                          ``model.language_model.layers.{L}.mlp.shared_expert_gate.weight``
``mixtral``               ``model.layers.{L}.block_sparse_moe.experts.{E}.w{1,3,2}.weight``
                          (gate, up, down), ``model.layers.{L}.block_sparse_moe.gate.weight``
========================  ==========================================================

``lm_head.weight`` is stored un-tied for every arch.  Transformers (v5) fuses
the per-expert tensors into ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate
rows first, then up) and ``mlp.experts.down_proj`` ``[E, H, I]`` when loading
(and strips the ``language_model.`` part of the Qwen3.5 names).

The tokenizer is a byte-level BPE (Qwen-style pre-tokenisation) trained on a
small built-in English text; ids 0/1/2 are ``<|endoftext|>`` (pad),
``<|im_start|>`` (bos) and ``<|im_end|>`` (eos).  So that greedy output decodes
to readable text, the ``lm_head`` rows of pad, bos, non-printable byte tokens
and ids past the tokenizer's end are zero (the eos row stays random, so
generation can stop early on eos).  ``tokenizer_config.json`` carries a ChatML chat
template (the ``<|im_start|>role ... <|im_end|>`` turns of Qwen's checkpoints), so the
tiny models answer chat requests the way real chat checkpoints do.

Importing this module is cheap: torch, transformers, safetensors and
tokenizers are imported inside the function.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any

__all__ = ["ARCHES", "make_tiny_checkpoint"]

ARCHES: tuple[str, ...] = ("qwen3_moe", "qwen3_5_moe", "mixtral")

# ---------------------------------------------------------------------------
# Shared sizes.
# ---------------------------------------------------------------------------
_VOCAB_SIZE = 512  # config vocab size; the tokenizer has at most this many tokens
_HIDDEN = 64
_LAYERS = 4
_EXPERTS = 8
_TOP_K = 2
_MOE_INTERMEDIATE = 32
_PAD_ID, _BOS_ID, _EOS_ID = 0, 1, 2
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 = pad, bos, eos
# ChatML, as Qwen's checkpoints write their turns; ends with the assistant's opening line
# when asked for a generation prompt.
_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2/3/3.5 byte-level BPE pre-tokenisation regex.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Standard deviations of the random weights.  Every weight matrix (attention,
# gated-delta-net projections, experts, routers, shared experts, lm_head) is
# N(0, _INIT_STD); the token embeddings are N(0, _EMBED_STD).  With these the
# routed experts clearly matter (dropping them changes ~40% of the argmax
# predictions) and greedy decoding yields varied tokens instead of collapsing
# onto one repeated token, as it tends to with a uniformly small std.
_INIT_STD = 0.1
_EMBED_STD = 1.0

# A small built-in English text to train the byte-level BPE on.
_CORPUS = """\
Hello world! This is a tiny model used for testing a distributed mixture of experts
inference system. The quick brown fox jumps over the lazy dog. A mixture of experts
layer sends every token to a few experts chosen by a router, and the outputs of those
experts are added together with the weights given by the router.
The weather today is sunny with a light breeze from the west. In the morning the
market was busy: people were buying bread, apples, cheese, fish and fresh flowers.
Once upon a time there was a small village at the edge of a large forest. The people
of the village told stories about the old tree that stood in the middle of the woods.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9.
Questions and answers: What is your name? My name is Kvasir. Where do you live? I live
on a server in a rack in a data center, and I answer questions for anyone who asks.
The server sends the hidden states to the next worker, which runs its layers and
returns the result. Each worker holds a subset of the experts of every layer.
Good morning, good evening, good night. Thank you very much. You are welcome.
"""


def _configs() -> dict[str, dict[str, Any]]:
    """Return ``config.json`` contents per arch (plain JSON-serialisable dicts)."""
    common: dict[str, Any] = {
        "vocab_size": _VOCAB_SIZE,
        "hidden_size": _HIDDEN,
        "num_hidden_layers": _LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "num_experts_per_tok": _TOP_K,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": _BOS_ID,
        "eos_token_id": _EOS_ID,
        "pad_token_id": _PAD_ID,
        "dtype": "float32",
        "torch_dtype": "float32",
    }
    qwen3_moe = {
        **common,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": _LAYERS,
        "intermediate_size": 128,  # dense MLP size; unused since every layer is MoE
        "moe_intermediate_size": _MOE_INTERMEDIATE,
        "num_experts": _EXPERTS,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    qwen3_5_moe = {
        **common,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "head_dim": 32,
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        # Published Qwen3.5 style (interleaved M-RoPE on a quarter of the head dim);
        # mrope_section sums to head_dim * partial_rotary_factor / 2 = 4.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "layer_types": [
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
        "full_attention_interval": 2,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": _MOE_INTERMEDIATE,
        "shared_expert_intermediate_size": _MOE_INTERMEDIATE,
        "num_experts": _EXPERTS,
    }
    mixtral = {
        **common,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_window": None,
        "intermediate_size": _MOE_INTERMEDIATE,  # per-expert FFN size in Mixtral
        "num_local_experts": _EXPERTS,
        "router_jitter_noise": 0.0,
    }
    return {"qwen3_moe": qwen3_moe, "qwen3_5_moe": qwen3_5_moe, "mixtral": mixtral}


def _on_disk_name(arch: str, name: str) -> str:
    """Map a (non-expert) transformers parameter name to its published on-disk name."""
    if arch == "mixtral":
        return name.replace(".mlp.", ".block_sparse_moe.")
    if arch == "qwen3_5_moe" and name.startswith("model."):
        return "model.language_model." + name[len("model.") :]
    return name


def _expert_names(arch: str, layer_prefix: str, expert: int) -> tuple[str, str, str]:
    """On-disk (gate, up, down) names of one expert; ``layer_prefix`` ends in ``.mlp``."""
    if arch == "mixtral":
        base = _on_disk_name(arch, f"{layer_prefix}.experts.{expert}")
        return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"
    base = _on_disk_name(arch, f"{layer_prefix}.experts.{expert}")
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"


def _random_state_dict(
    arch: str, path: pathlib.Path, seed: int, silent_ids: list[int]
) -> dict[str, Any]:
    """Build the model from ``path/config.json`` and return its on-disk state dict.

    ``silent_ids`` are vocabulary ids whose ``lm_head`` rows are set to zero.
    """
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path))
    # Mix the arch into the seed so different archs get unrelated weights.
    digest = hashlib.sha256(f"kvasir-tiny:{arch}:{seed}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    # Model construction consumes the global RNG; keep the caller's RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        # named_parameters order is the (deterministic) module definition order.
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if name.endswith("linear_attn.A_log"):
                # Same distribution as the model's own init: A ~ U(0.01, 16).
                value = torch.empty(shape).uniform_(0.01, 16.0, generator=gen).log_()
            elif param.dim() >= 2:
                std = _EMBED_STD if name.endswith("embed_tokens.weight") else _INIT_STD
                value = torch.empty(shape).normal_(0.0, std, generator=gen)
                if name == "lm_head.weight":
                    value[silent_ids] = 0.0
            else:
                # RMSNorm weights (ones, or zeros for Qwen3.5's 1-centred norms),
                # dt_bias (ones): keep the model's own constant initialisation.
                value = param.detach().to(torch.float32).clone()
            param.copy_(value)

            if name.endswith(".mlp.experts.gate_up_proj"):
                layer_prefix = name[: -len(".experts.gate_up_proj")]
                inter = shape[1] // 2
                for e in range(shape[0]):
                    gate_name, up_name, _ = _expert_names(arch, layer_prefix, e)
                    out[gate_name] = value[e, :inter, :].clone().contiguous()
                    out[up_name] = value[e, inter:, :].clone().contiguous()
            elif name.endswith(".mlp.experts.down_proj"):
                layer_prefix = name[: -len(".experts.down_proj")]
                for e in range(shape[0]):
                    _, _, down_name = _expert_names(arch, layer_prefix, e)
                    out[down_name] = value[e].clone().contiguous()
            else:
                out[_on_disk_name(arch, name)] = value.contiguous()
    if "lm_head.weight" not in out:  # pragma: no cover - every arch here is untied
        raise RuntimeError("expected an untied lm_head.weight")
    return out


def _write_tokenizer(directory: pathlib.Path, max_vocab: int) -> Any:
    """Train a byte-level BPE on the built-in text, save it, return the ``Tokenizer``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Same pipeline as Qwen2/Qwen3/Qwen3.5's byte-level BPE.  (transformers 5
    # loads a ``qwen3_5_moe_text`` checkpoint's tokenizer with its own
    # Qwen3_5Tokenizer class, which rebuilds exactly this pipeline from the
    # vocab and merges, so both load paths tokenize identically.)
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max_vocab,
        min_frequency=2,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train single-threaded: deterministic, and it does not mark the process as
    # having used Rust-side parallelism (which makes `tokenizers` warn on fork).
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old
    for tid, token in enumerate(_SPECIAL_TOKENS):
        if tok.token_to_id(token) != tid:  # pragma: no cover - trainer puts specials first
            raise RuntimeError(f"special token {token!r} did not get id {tid}")

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_SPECIAL_TOKENS[_BOS_ID],
        eos_token=_SPECIAL_TOKENS[_EOS_ID],
        pad_token=_SPECIAL_TOKENS[_PAD_ID],
        unk_token=_SPECIAL_TOKENS[_PAD_ID],  # never produced (full byte alphabet)
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(directory))
    # Record the class explicitly (AutoTokenizer needs it for unknown model types).
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = _CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return tok


def _unreadable_ids(tok: Any, vocab_size: int) -> list[int]:
    """Ids whose ``lm_head`` rows are zeroed so greedy output decodes to readable text.

    These are: ids past the end of the tokenizer, ``<|endoftext|>`` (pad) and
    ``<|im_start|>`` (bos), and tokens that decode to non-printable text
    (control bytes, lone UTF-8 continuation bytes).  The eos token keeps a
    random row.  A zero row gives logit 0, below the best random logit, so
    such ids are (practically) never picked by greedy decoding.
    """
    n = tok.get_vocab_size(with_added_tokens=True)
    bad = [i for i in range(n) if i in (_PAD_ID, _BOS_ID)]
    for i in range(len(_SPECIAL_TOKENS), n):
        text = tok.decode([i], skip_special_tokens=False)
        if not text or "\ufffd" in text or not text.replace("\n", " ").isprintable():
            bad.append(i)
    bad.extend(range(n, vocab_size))
    return bad


def make_tiny_checkpoint(
    directory: str | os.PathLike[str],
    *,
    arch: str = "qwen3_moe",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Write a tiny random MoE checkpoint in the Hugging Face layout.

    Args:
        directory: Where to write; created (with parents) if missing.  Existing
            files of the same names are overwritten.
        arch: One of :data:`ARCHES` -- ``"qwen3_moe"`` (Qwen3MoeForCausalLM),
            ``"qwen3_5_moe"`` (text-only Qwen3_5MoeForCausalLM, model_type
            ``qwen3_5_moe_text``, with gated-delta-net and full-attention layers
            and a shared expert) or ``"mixtral"`` (MixtralForCausalLM).
        seed: Seed for the random weights.  The same ``(arch, seed)`` always
            gives a byte-identical ``model.safetensors``.
        overrides: Config values to change (e.g. ``hidden_size``, ``num_experts``,
            ``moe_intermediate_size`` for a larger benchmark model; ``num_hidden_layers``
            for ``qwen3_moe`` and ``mixtral``).

    Returns:
        The checkpoint directory as a :class:`pathlib.Path`.  It holds
        ``config.json``, ``generation_config.json``, ``model.safetensors``
        (float32, per-expert tensors under published names, metadata
        ``{"format": "pt"}``), ``tokenizer.json`` and ``tokenizer_config.json``.
        Sizes: hidden 64, 4 layers (all MoE), 8 experts, top-2,
        moe_intermediate_size 32, vocab 512.

    Raises:
        ValueError: If ``arch`` is not one of :data:`ARCHES`.
    """
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; valid choices are: {', '.join(ARCHES)}")
    seed = int(seed)

    from safetensors.torch import save_file
    from transformers import GenerationConfig

    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)

    config_dict = {**_configs()[arch], **(overrides or {})}
    if arch == "qwen3_moe":
        config_dict["max_window_layers"] = config_dict["num_hidden_layers"]
    vocab_size = int(config_dict["vocab_size"])
    tok = _write_tokenizer(path, vocab_size)
    if tok.get_vocab_size(with_added_tokens=True) > vocab_size:  # pragma: no cover
        raise RuntimeError("tokenizer is larger than the model's vocab_size")
    silent_ids = _unreadable_ids(tok, vocab_size)

    (path / "config.json").write_text(
        json.dumps(config_dict, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    GenerationConfig(
        bos_token_id=_BOS_ID,
        eos_token_id=_EOS_ID,
        pad_token_id=_PAD_ID,
        do_sample=False,
    ).save_pretrained(str(path))

    state = _random_state_dict(arch, path, seed, silent_ids)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
