"""The expert kernel in numpy, for a worker without torch: the same expert functions
(``ExpertFunction``: GLU with any of the MoE checkpoints' activations, the clamped GLU, gpt-oss's
clamped SwiGLU; interleaved, transposed, biases) computed in float32 whatever the model's
dtype, and the request's checks as ``validate_dispatch`` makes them.

Not bitwise torch's: BLAS sums in its own order, and a bfloat16 or float16 model's values are
rounded once at the end here rather than after each operation. The backbone's row checks and
audits bound exactly this kind of difference (an honest float32 worker), so such a worker's
answers pass them, "within the audit bound, tokens identical" (docs/PROTOCOL.md 11)."""

from __future__ import annotations

import ctypes
import glob
import math
import os
from collections.abc import Callable, Sequence

import numpy as np

from kvasir_rpc._function import CLAMPED_GLU, CLAMPED_SWIGLU, GLU, ExpertFunction
from kvasir_rpc._segments import DispatchInputError, check_call_rows

__all__ = ["NP_ACTIVATIONS", "check_function_np", "expert_forward_np", "set_blas_threads", "torch_installed",
           "validate_dispatch_np"]

NpActivation = Callable[[np.ndarray], np.ndarray]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x < -88: 1 / inf = 0, right
        return np.float32(1) / (np.float32(1) + np.exp(-x))


def _silu(x: np.ndarray) -> np.ndarray:
    return x * _sigmoid(x)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    inner = np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1) + np.tanh(inner))


_ERF = np.frompyfunc(math.erf, 1, 1)


def _gelu(x: np.ndarray) -> np.ndarray:
    # erf exactly (math.erf, in float64, element by element): numpy has none of its own.
    erf = np.asarray(_ERF(x.astype(np.float64) / math.sqrt(2.0)), dtype=np.float64)
    return (0.5 * x.astype(np.float64) * (1.0 + erf)).astype(np.float32)


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, np.float32(0))


#: transformers' ``hidden_act`` names (its ACT2FN) this kernel computes, in float32.
NP_ACTIVATIONS: dict[str, NpActivation] = {
    "silu": _silu,
    "swish": _silu,
    "relu": _relu,
    "relu2": lambda x: np.square(_relu(x)),
    "gelu": _gelu,
    "gelu_python": _gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "quick_gelu": lambda x: x * _sigmoid(np.float32(1.702) * x),
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
}


def _activation(name: str) -> NpActivation:
    act = NP_ACTIVATIONS.get(name)
    if act is None:
        raise ValueError(f"the activation {name!r} is not computed without torch (known: "
                         f"{', '.join(sorted(NP_ACTIVATIONS))}); run the torch worker (pip install kvasir-rpc)")
    return act


def check_function_np(fn: ExpertFunction) -> None:
    """Raise ValueError, saying what to do, when ``fn`` is not one this kernel computes."""
    if fn.gate != CLAMPED_SWIGLU:
        _activation(fn.activation)


def _split(fn: ExpertFunction, gu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if fn.interleaved:
        return gu[..., ::2], gu[..., 1::2]
    inter = gu.shape[-1] // 2
    return gu[..., :inter], gu[..., inter:]


def _combine(fn: ExpertFunction, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    limit = np.float32(fn.limit)
    if fn.gate == GLU:
        return _activation(fn.activation)(g) * u
    if fn.gate == CLAMPED_GLU:
        return _activation(fn.activation)(np.minimum(g, limit)) * np.clip(u, -limit, limit)
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + np.float32(1)) * (g * _sigmoid(g * np.float32(fn.alpha)))


def expert_forward_np(
    hidden: np.ndarray,  # [n, H] float32
    gate_up: np.ndarray,  # [2I, H] ([H, 2I] transposed) float32
    down: np.ndarray,  # [H, I] ([I, H] transposed) float32
    fn: ExpertFunction,
    weights: np.ndarray,  # [n] float32
    biases: tuple[np.ndarray, np.ndarray] | None = None,  # ([2I], [H]) float32 with fn.bias
) -> tuple[np.ndarray, np.ndarray]:
    """One expert over ``n`` rows, each scaled by its routing weight, in float32: ``(partials
    [n, H], projections [g | u] [n, 2I])``, what ``kvasir_rpc.expert_forward_projections``
    returns (biases added, all gates then all ups when interleaved). Raises ValueError for a
    function with biases given none, or an activation this kernel does not know."""
    if fn.bias and biases is None:
        raise ValueError(f"the expert function ({fn.describe()}) has biases; none were given")
    gu = hidden @ gate_up if fn.transposed else hidden @ gate_up.T  # [n, 2I]
    if fn.bias:
        assert biases is not None
        gu = gu + biases[0]
    g, u = _split(fn, gu)  # [n, I] each
    h = _combine(fn, g, u)  # [n, I]
    y = h @ down if fn.transposed else h @ down.T  # [n, H]
    if fn.bias:
        assert biases is not None
        y = y + biases[1]
    projections = np.concatenate([g, u], axis=-1) if fn.interleaved else gu
    return (y * weights[:, None]).astype(np.float32, copy=False), projections.astype(np.float32, copy=False)


# Narrower dtypes a float32 model's rows may travel in (``_kernel.WIRE_DTYPES``).
_NARROW = ("bfloat16", "float16")


def _all_finite(x: np.ndarray) -> bool:
    """Whether no element is NaN or infinite (one reduction when that is so: ``_kernel.all_finite``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if bool(np.isfinite(x.sum(dtype=np.float32))):
            return True
    return bool(np.isfinite(x).all())


def validate_dispatch_np(
    hidden: np.ndarray,
    hidden_dtype: str,
    weights: np.ndarray,
    weights_dtype: str,
    segments: Sequence[tuple[int, int]],
    *,
    hidden_size: int,
    dtype: str,
    max_rows: int,
    row_index: np.ndarray | None = None,
) -> None:
    """``kvasir_rpc.validate_dispatch`` on decoded arrays (``decode_array``: values and the wire
    dtype's name), with its messages. Raises DispatchInputError."""
    if hidden.ndim != 2 or hidden.shape[1] != hidden_size:
        raise DispatchInputError(f"hidden must have shape [rows, {hidden_size}], got {list(hidden.shape)}")
    if hidden_dtype != dtype and not (dtype == "float32" and hidden_dtype in _NARROW):
        narrow = " (or torch.bfloat16 / torch.float16 on a narrow wire)" if dtype == "float32" else ""
        raise DispatchInputError(f"hidden must be torch.{dtype}{narrow}, got torch.{hidden_dtype}")
    check_call_rows(rows=hidden.shape[0], segments=segments, max_rows=max_rows, weights_shape=list(weights.shape),
                    index_size=None if row_index is None else row_index.size,
                    index_max=int(row_index.max()) if row_index is not None and row_index.size else None)
    if weights_dtype not in ("float32", "float16", "bfloat16"):
        raise DispatchInputError(f"weights must be floating point, got torch.{weights_dtype}")
    if not _all_finite(hidden) or not _all_finite(weights):
        raise DispatchInputError("hidden or weights hold NaN or Inf")


def torch_installed() -> bool:
    """Whether torch can be imported here (found, not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def set_blas_threads(n: int) -> bool:
    """Have numpy's matrix products use ``n`` threads (the OpenBLAS its wheels bundle reads
    OPENBLAS_NUM_THREADS only when it loads, so this asks the loaded library). False when no
    such library is found (another BLAS): then its own environment variable applies."""
    folder = os.path.dirname(np.__file__) + ".libs"
    for path in sorted(glob.glob(os.path.join(folder, "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                return True
    return False
