"""The activations of Mixture-of-Experts checkpoints, as the torch functions transformers runs
for them: what an expert function's GLU applies (``kvasir_rpc._function``) and the kernel
computes (``kvasir_rpc._kernel``), in a module of their own so those two import it, not
each other."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["Activation", "get_activation"]

Activation = Callable[[torch.Tensor], torch.Tensor]


# The activations of MoE checkpoints, as the torch functions transformers' ACT2FN calls for
# them (its SiLUActivation and nn.SiLU both run F.silu; nn.ReLU runs F.relu): bitwise the same,
# checked against ACT2FN in tests/test_kernel.py. Importing transformers.activations costs a
# worker ~2.3 s of CPU at start (it pulls in torch.distributed.tensor and hub kernels), most of
# a worker's start-up; other names still come from transformers.
_TORCH_ACTIVATIONS: dict[str, Activation] = {"silu": F.silu, "swish": F.silu, "relu": F.relu}


def get_activation(name: str) -> Activation:
    """The activation transformers uses for ``hidden_act=name``: the same function, bitwise."""
    act = _TORCH_ACTIVATIONS.get(name)
    if act is not None:
        return act
    from transformers.activations import ACT2FN

    return ACT2FN[name]  # type: ignore[no-any-return]
