"""The expert kernel's activations: the ones it takes from torch directly (so a worker starts
without importing transformers) are bitwise transformers' own for the same ``hidden_act``."""

from __future__ import annotations

import pytest
import torch

from kvasir_rpc import get_activation
from kvasir_rpc._activation import _TORCH_ACTIVATIONS


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4096, generator=gen) * 8
    edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30, 88.0, -88.0, 1e4])
    return torch.cat([x, edges]).to(dtype)


@pytest.mark.parametrize("name", sorted(_TORCH_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_activation_is_bitwise_transformers_own(name, dtype):
    from transformers.activations import ACT2FN

    x = _inputs(dtype)
    ours, theirs = get_activation(name)(x.clone()), ACT2FN[name](x.clone())
    assert ours.dtype == theirs.dtype == dtype
    # Bitwise, NaN included: compare the raw bits.
    assert torch.equal(ours.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       theirs.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_other_activations_still_come_from_transformers():
    from transformers.activations import ACT2FN

    act = get_activation("gelu_pytorch_tanh")
    assert type(act) is type(ACT2FN["gelu_pytorch_tanh"])
    with pytest.raises(KeyError):
        get_activation("no-such-activation")


@pytest.mark.integration
def test_a_worker_process_loads_its_experts_without_importing_transformers(tmp_path, tiny_models):
    """A worker's start-up is its imports; transformers' would be most of it."""
    import subprocess
    import sys

    code = ("import sys; from worker._load import load_experts; import worker._service, worker._tunnel; "
            f"load_experts({str(tiny_models('qwen3_moe'))!r}, '*:0-3', 'cpu'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
