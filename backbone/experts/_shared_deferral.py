"""Shared-expert deferral: Qwen3.5's shared expert computed while the remote calls fly.

Qwen3.5-style blocks compute ``shared_expert(x)`` before they call the experts and use it
only after the experts return. With remote experts its compute is moved into that layer's
experts call, after the remote calls leave: the shared expert's ``forward`` (an instance
attribute; modules and weights stay as they are) returns an empty tensor of the right shape
and notes its input; ``run(layer)`` fills that tensor with the shared expert's own output,
same ops on the same input, so the result is bitwise unchanged. A hook on the block checks
that the tensor was filled before the block returns and raises otherwise, should a later
transformers change the order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from backbone.experts._weights import layer_of

__all__ = ["SharedDeferral"]


class SharedDeferral:
    """Defers the shared experts of ``model``'s MoE blocks whose experts are ``experts``.

    ``deferring()`` says whether to defer now (remote experts are in use); the deferral also
    needs the block's experts to run ``implementation`` and no autograd. Pending outputs are
    kept per thread: decode groups run the model in several threads at once."""

    def __init__(self, model: torch.nn.Module, experts: dict[int, torch.nn.Module], *, implementation: str,
                 deferring: Callable[[], bool]) -> None:
        self._implementation = implementation
        self._deferring = deferring
        self._pending = threading.local()
        self._lock = threading.Lock()
        self.overlapped = 0  # shared experts computed inside an experts call
        for name, block in model.named_modules():
            shared = getattr(block, "shared_expert", None)
            layer = layer_of(name)
            if not isinstance(shared, torch.nn.Module) or layer is None or experts.get(layer) is not getattr(
                    block, "experts", None):
                continue
            previous = getattr(shared, "_kvasir_shared", None)
            if previous is not None:  # a deferral attached to this model before: replace it
                compute, handle = previous
                handle.remove()
            else:
                compute = shared.forward
            shared.forward = self._deferred(layer, compute, experts[layer])  # type: ignore[method-assign]
            handle = block.register_forward_hook(self._check_filled(layer))
            shared._kvasir_shared = (compute, handle)  # type: ignore[assignment]

    def _by_layer(self) -> dict[int, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor]]:
        return self._pending.__dict__.setdefault("by_layer", {})  # type: ignore[no-any-return]

    def _deferred(self, layer: int, compute: Callable[[torch.Tensor], torch.Tensor],
                  experts: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        config = getattr(experts, "config", None)

        def forward(x: torch.Tensor) -> torch.Tensor:
            ours = getattr(config, "_experts_implementation", None) == self._implementation
            pending = self._by_layer()
            if not (ours and self._deferring()) or torch.is_grad_enabled():
                pending.pop(layer, None)  # nothing stale from a forward that raised
                return compute(x)
            out = torch.empty_like(x)
            pending[layer] = (compute, x, out)
            return out

        return forward

    def _check_filled(self, layer: int) -> Callable[[torch.nn.Module, object, object], None]:
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            if self._by_layer().pop(layer, None) is not None:
                raise RuntimeError(f"layer {layer}: the shared expert's output was used before the experts call "
                                   "computed it; this transformers version orders the MoE block differently")

        return hook

    def run(self, layer: int) -> None:
        """Compute ``layer``'s deferred shared expert, if this thread has one pending."""
        pending = self._by_layer().pop(layer, None)
        if pending is not None:
            compute, x, out = pending
            out.copy_(compute(x))
            with self._lock:
                self.overlapped += 1
