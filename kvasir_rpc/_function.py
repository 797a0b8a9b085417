"""What a routed expert computes: the expert function, written down.

Every MoE family transformers ships computes, for one row x routed to one expert with weight w::

    g = G x (+ b_g),  u = U x (+ b_u),  h = gate(g, u),  y = w * (D h (+ b_d))

and they differ in four things only: how g and u combine (``gate``: act(g) * u with an
activation, or gpt-oss's clamped SwiGLU with its alpha and limit), whether the gate and up
outputs are stored one block after the other or alternating (``interleaved``), whether the
checkpoint stores the projections [in, out] (``transposed``), and biases. ``ExpertFunction``
holds those facts; the kernel (``_kernel.expert_forward``) computes any of them, operation by
operation as transformers' eager experts do; the hello and the model card carry them
(``function.proto``), so a worker written from docs/PROTOCOL.md knows what to compute.

The backbone reads the function from transformers' own declaration of the experts module
(``function_of_module``); a worker, which does not import transformers, from the
checkpoint (``ExpertIndex.function``: the config and the expert tensors' names and shapes); the
backbone uses a worker only when the two agree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvasir_rpc._activation import Activation

__all__ = ["CLAMPED_GLU", "CLAMPED_SWIGLU", "GLU", "ExpertFunction", "announced_mismatch", "as_function",
           "function_of_module"]

GLU = "glu"  # h = act(g) * u
CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss: h = (clamp(u) + 1) * g' sigmoid(alpha g'), g' = min(g, limit)
CLAMPED_GLU = "clamped_glu"  # DeepSeek-V4, Hunyuan V4: h = act(min(g, limit)) * clamp(u)
_GATES = (GLU, CLAMPED_SWIGLU, CLAMPED_GLU)
_PROTO_GATES = {GLU: 1, CLAMPED_SWIGLU: 2, CLAMPED_GLU: 3}  # kvasir.v1.ExpertGate


@dataclasses.dataclass(frozen=True)
class ExpertFunction:
    """One expert function (see the module's docstring). The default is the function of most
    families: SwiGLU over concatenated [gate; up] weights stored [out, in], no biases."""

    gate: str = GLU
    activation: str = "silu"  # GLU's activation, by transformers' hidden_act name; "" otherwise
    alpha: float = 0.0  # CLAMPED_SWIGLU's
    limit: float = 0.0
    interleaved: bool = False
    transposed: bool = False
    bias: bool = False

    def __post_init__(self) -> None:
        if self.gate not in _GATES:
            raise ValueError(f"unknown expert gate {self.gate!r} (known: {', '.join(_GATES)})")
        if self.gate != CLAMPED_SWIGLU and not self.activation:
            raise ValueError(f"a {self.gate} expert function needs an activation")
        if self.gate == CLAMPED_SWIGLU and not (math.isfinite(self.alpha) and math.isfinite(self.limit)
                                                and self.limit > 0):
            raise ValueError(f"a clamped SwiGLU needs a finite alpha and a positive limit "
                             f"(got alpha={self.alpha}, limit={self.limit})")
        if self.gate == CLAMPED_GLU and not (math.isfinite(self.limit) and self.limit > 0):
            raise ValueError(f"a clamped GLU needs a positive limit (got {self.limit})")

    @property
    def plain(self) -> bool:
        """The function every worker computed before functions were written down: GLU over
        concatenated weights stored [out, in], no biases (any activation)."""
        return self.gate == GLU and not (self.interleaved or self.transposed or self.bias)

    @functools.cached_property
    def act(self) -> Activation:
        """GLU's activation (the torch function transformers' ACT2FN runs for the name)."""
        from kvasir_rpc._activation import get_activation

        return get_activation(self.activation)

    def split(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, u)`` from the projections' output as stored, [..., 2I] (views, no copy)."""
        if self.interleaved:
            return gate_up[..., ::2], gate_up[..., 1::2]
        inter = gate_up.shape[-1] // 2
        return gate_up[..., :inter], gate_up[..., inter:]

    def combine(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``h`` from g and u, each operation as transformers' eager experts run it (so, in
        the same dtype, the same bits)."""
        if self.gate == GLU:
            return self.act(g) * u
        if self.gate == CLAMPED_GLU:
            return self.act(g.clamp(max=self.limit)) * u.clamp(min=-self.limit, max=self.limit)
        import torch

        g = g.clamp(min=None, max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        glu = g * torch.sigmoid(g * self.alpha)
        return (u + 1) * glu

    def factors(self, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, b)`` with ``h = a * b`` (up to rounding), ``a`` the factor of g, ``b`` of u: what
        the row checks need to bound how far h moves when g and u move by their rounding."""
        if self.gate == GLU:
            return self.act(g), u
        if self.gate == CLAMPED_GLU:
            return self.act(g.clamp(max=self.limit)), u.clamp(-self.limit, self.limit)
        import torch

        gc = g.clamp(max=self.limit)
        return gc * torch.sigmoid(gc * self.alpha), u.clamp(-self.limit, self.limit) + 1

    @property
    def roundings(self) -> int:
        """How many operations, each rounded to the compute dtype, make h from g and u (the
        activation counted as one): its error, in units of the compute dtype's roundoff."""
        return 5 if self.gate == CLAMPED_SWIGLU else 2  # g*alpha, sigmoid, g*, u+1, *  |  act, *

    def matrices(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(G [I, H], U [I, H], D [H, I])`` as views of one expert's stored weights."""
        if self.transposed:  # gate_up [H, 2I], down [I, H]
            g, u = self.split(gate_up)
            return g.T, u.T, down.T
        if self.interleaved:
            return gate_up[::2], gate_up[1::2], down
        inter = gate_up.shape[0] // 2
        return gate_up[:inter], gate_up[inter:], down

    def describe(self) -> str:
        """One line, e.g. ``clamped SwiGLU (alpha 1.702, limit 7), interleaved, transposed, biases``."""
        head = {GLU: f"GLU with {self.activation}",
                CLAMPED_GLU: f"clamped GLU with {self.activation} (limit {self.limit:g})",
                CLAMPED_SWIGLU: f"clamped SwiGLU (alpha {self.alpha:g}, limit {self.limit:g})"}[self.gate]
        traits = [t for t, on in (("interleaved", self.interleaved), ("transposed", self.transposed),
                                  ("biases", self.bias)) if on]
        return ", ".join([head, *traits])

    def to_proto(self, layers: tuple[int, ...] = ()) -> Any:
        """As a ``kvasir.v1.ExpertFunction``."""
        from kvasir_rpc._gen.kvasir.v1 import function_pb2

        return function_pb2.ExpertFunction(
            gate=_PROTO_GATES[self.gate],  # type: ignore[arg-type]
            activation=self.activation if self.gate != CLAMPED_SWIGLU else "",
            alpha=self.alpha, limit=self.limit,
            interleaved=self.interleaved, transposed=self.transposed, bias=self.bias, layers=list(layers))

    @classmethod
    def from_proto(cls, msg: Any, *, default_activation: str) -> ExpertFunction:
        """A ``kvasir.v1.ExpertFunction`` as received; unset (a peer from before the message):
        the plain function with ``default_activation`` (the checkpoint's hidden_act). Raises
        ValueError for a gate this project does not know, or parameters that make no function."""
        from kvasir_rpc._gen.kvasir.v1 import function_pb2

        if msg.gate == function_pb2.EXPERT_GATE_UNSPECIFIED and not (msg.interleaved or msg.transposed or msg.bias):
            return cls(activation=msg.activation or default_activation)
        if msg.gate in (function_pb2.EXPERT_GATE_UNSPECIFIED, function_pb2.EXPERT_GATE_GLU):
            return cls(activation=msg.activation or default_activation, interleaved=msg.interleaved,
                       transposed=msg.transposed, bias=msg.bias)
        if msg.gate == function_pb2.EXPERT_GATE_CLAMPED_SWIGLU:
            return cls(gate=CLAMPED_SWIGLU, activation="", alpha=msg.alpha, limit=msg.limit,
                       interleaved=msg.interleaved, transposed=msg.transposed, bias=msg.bias)
        if msg.gate == function_pb2.EXPERT_GATE_CLAMPED_GLU:
            return cls(gate=CLAMPED_GLU, activation=msg.activation or default_activation, limit=msg.limit,
                       interleaved=msg.interleaved, transposed=msg.transposed, bias=msg.bias)
        raise ValueError(f"expert gate {msg.gate} is not one this project computes")

    @classmethod
    def from_config(cls, text_config: dict[str, Any], *, transposed: bool, bias: bool) -> ExpertFunction:
        """The function a checkpoint's config says (docs/PROTOCOL.md §11.2): with ``swiglu_alpha``
        and ``swiglu_limit``, the clamped SwiGLU (interleaved when the weights are stored
        transposed, as gpt-oss's are); with ``swiglu_limit`` alone, the clamped GLU with
        ``hidden_act``; else GLU with ``hidden_act``. ``transposed`` and ``bias`` come from the
        expert tensors (``ExpertIndex``)."""
        limit, alpha = text_config.get("swiglu_limit"), text_config.get("swiglu_alpha")
        act = str(text_config.get("hidden_act", "silu"))
        if limit is not None and alpha is not None:
            return cls(gate=CLAMPED_SWIGLU, activation="", alpha=float(alpha), limit=float(limit),
                       interleaved=transposed, transposed=transposed, bias=bias)
        if limit is not None:
            return cls(gate=CLAMPED_GLU, activation=act, limit=float(limit), transposed=transposed, bias=bias)
        return cls(activation=act, transposed=transposed, bias=bias)


def announced_mismatch(announced: Any | None, mine: ExpertFunction) -> str:
    """Why a worker that announced ``announced`` (a ``kvasir.v1.ExpertFunction``; None: it
    announced none, as workers before the field) does not compute ``mine``; "" when it does.
    An unset function is the plain one with the checkpoint's activation."""
    if announced is None:
        return "" if mine.plain else f"the worker announces no expert function; this model's is {mine.describe()}"
    try:
        theirs = ExpertFunction.from_proto(announced, default_activation=mine.activation)
    except ValueError as exc:
        return f"the worker's expert function: {exc}"
    if theirs != mine:
        return f"the worker computes {theirs.describe()}; this model's is {mine.describe()}"
    return ""


class _GivenActivation(ExpertFunction):
    """The plain function with an activation given as a callable rather than by name."""

    def __init__(self, act: Activation) -> None:
        super().__init__(activation=getattr(act, "__name__", "given"))
        self.__dict__["act"] = act  # where functools.cached_property keeps its value


def as_function(fn: Activation | ExpertFunction) -> ExpertFunction:
    """``fn`` as an ExpertFunction: an activation alone stands for the plain function with it."""
    return fn if isinstance(fn, ExpertFunction) else _GivenActivation(fn)


# transformers' hidden_act names an experts module's act_fn is tried against when the config's
# own name is not its function (Aria's experts are always SiLU whatever hidden_act says).
_ACTIVATIONS = ("silu", "gelu", "relu", "gelu_pytorch_tanh", "gelu_new", "swish", "relu2", "sigmoid", "tanh")


def function_of_module(module: Any) -> ExpertFunction:
    """The expert function of a transformers experts module, from what transformers declares of
    it (the traits ``use_experts_implementation`` gives it, its ``act_fn``, a gate function of
    its own and the parameters it keeps): each candidate is checked against the module's own
    gate on random values, bit for bit, in the module's dtype. Raises ValueError naming what the
    module declares that no function here computes."""
    import torch
    from transformers.integrations.moe import _default_apply_gate

    config = getattr(module, "config", None)  # use_experts_implementation keeps the model's config there
    model_type = getattr(config, "model_type", None) or "this model"
    name = type(module).__name__
    why = []
    if not getattr(module, "has_gate", True):
        why.append("no gate (has_gate=False)")
    if getattr(module, "has_post_expert_norm", False):
        why.append("a norm after each expert")
    if not (isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(module, "down_proj", None), torch.Tensor)):
        why.append("no gate_up_proj/down_proj weights")
    bias = bool(getattr(module, "has_bias", False))
    if bias and not (hasattr(module, "gate_up_proj_bias") and hasattr(module, "down_proj_bias")):
        why.append("biases under other names than gate_up_proj_bias/down_proj_bias")
    if why:
        raise ValueError(f"{model_type}'s experts ({name}) are not served yet: they declare {', '.join(why)}")
    traits: dict[str, Any] = {"interleaved": not getattr(module, "is_concatenated", True),
                              "transposed": bool(getattr(module, "is_transposed", False)), "bias": bias}
    own_gate = getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate
    named = getattr(config, "hidden_act", None)
    acts = [*([named] if isinstance(named, str) else []), *_ACTIVATIONS]
    candidates: list[ExpertFunction] = []
    if own_gate:
        alpha = next((v for v in (getattr(module, "alpha", None), getattr(module, "swiglu_alpha", None))
                      if isinstance(v, (int, float))), None)
        limit = next((v for v in (getattr(module, "limit", None), getattr(module, "swiglu_limit", None))
                      if isinstance(v, (int, float))), None)
        if limit is not None and limit > 0:
            if alpha is not None:
                candidates.append(ExpertFunction(gate=CLAMPED_SWIGLU, activation="", alpha=float(alpha),
                                                 limit=float(limit), **traits))
            candidates.extend(ExpertFunction(gate=CLAMPED_GLU, activation=a, limit=float(limit), **traits)
                              for a in acts)
    elif callable(getattr(module, "act_fn", None)):
        candidates.extend(ExpertFunction(activation=a, **traits) for a in acts)
    probe = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).mul(4).to(module.gate_up_proj.dtype)
    with torch.no_grad():
        want = module._apply_gate(probe)
        for fn in candidates:
            try:
                got = fn.combine(*fn.split(probe))
            except (KeyError, ValueError):  # an activation name this transformers lacks
                continue
            if got.dtype == want.dtype and torch.equal(got, want):
                return fn
    what = (f"a gate function of their own ({name}._apply_gate)" if own_gate
            else "an activation (act_fn) none of " + ", ".join(_ACTIVATIONS) + " computes")
    raise ValueError(f"{model_type}'s experts ({name}) are not served yet: they compute {what} that matches no "
                     "expert function this project knows")

