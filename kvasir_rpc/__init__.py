"""Kvasir RPC shared library: protocol stubs, tensor codec, expert kernel, tunnel,
wallets, checkpoint reading and logging. Imports no component package.

Names that need torch (codec, kernel, checkpoint) load on first use, so the relay and the
ledger start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvasir_rpc._errors import CloseCode, LocalProtocolError, RemoteProtocolError, leaf_exception
from kvasir_rpc._gen.kvasir.v1 import (
    expert_pb2,
    expert_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
    tensor_pb2,
)
from kvasir_rpc._handshake import (
    HELLO_SIGNATURE_DOMAIN,
    HelloInfo,
    HubHandshake,
    WorkerHandshake,
    slices_from_proto,
    slices_to_proto,
)
from kvasir_rpc._log import configure_logging, get_logger
from kvasir_rpc._wallet import Wallet, WalletError, is_address, verify_signature

__version__ = "0.1.0"

_LAZY = {
    "TensorCodecError": "kvasir_rpc._codec",
    "encode_tensor": "kvasir_rpc._codec",
    "decode_tensor": "kvasir_rpc._codec",
    "CheckpointError": "kvasir_rpc._checkpoint",
    "ExpertIndex": "kvasir_rpc._checkpoint",
    "ModelInfo": "kvasir_rpc._checkpoint",
    "SpecError": "kvasir_rpc._checkpoint",
    "expert_digest": "kvasir_rpc._checkpoint",
    "format_slices": "kvasir_rpc._checkpoint",
    "parse_expert_spec": "kvasir_rpc._checkpoint",
    "read_model_info": "kvasir_rpc._checkpoint",
    "slices_digest": "kvasir_rpc._checkpoint",
    "expert_forward": "kvasir_rpc._kernel",
    "plan_routes": "kvasir_rpc._kernel",
    "Route": "kvasir_rpc._kernel",
    "get_activation": "kvasir_rpc._kernel",
    "DispatchInputError": "kvasir_rpc._kernel",
    "validate_dispatch": "kvasir_rpc._kernel",
    "ARCHES": "kvasir_rpc._tiny",
    "make_tiny_checkpoint": "kvasir_rpc._tiny",
}

__all__ = [
    "HELLO_SIGNATURE_DOMAIN",
    "CloseCode",
    "HelloInfo",
    "HubHandshake",
    "LocalProtocolError",
    "RemoteProtocolError",
    "Wallet",
    "WalletError",
    "WorkerHandshake",
    "__version__",
    "configure_logging",
    "leaf_exception",
    "expert_pb2",
    "expert_pb2_grpc",
    "get_logger",
    "is_address",
    "session_pb2",
    "session_pb2_grpc",
    "slices_from_proto",
    "slices_to_proto",
    "tensor_pb2",
    "verify_signature",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvasir_rpc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
