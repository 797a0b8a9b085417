"""Kvasir RPC shared library: protocol stubs, tensor codec, expert kernel, tunnel,
wallets, checkpoint reading, the row checks and the audit's tolerance, and logging. Only a
library: it imports no component and not the ``kvasir`` package (the command, the
local-swarm launcher, benchmarks, tiny checkpoints, the conformance check), and those use only
the names in ``__all__`` (tests/test_repo.py checks both).

Every name loads on first use: the gateway imports no protobuf or gRPC module and the
relay and the ledger start without torch, while ``from kvasir_rpc import X`` works for all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real names, for type checkers; at run time __getattr__ loads them
    from kvasir_rpc._access import (
        AUTHORIZATION_METADATA,
        MIN_TOKEN_CHARS,
        TARGET_KEY_METADATA,
        TokenError,
        bearer,
        check_bearer,
        load_or_create_token,
        load_token,
        target_key,
        target_key_matches,
    )
    from kvasir_rpc._activation import Activation, get_activation
    from kvasir_rpc._addr import address_key, remote_host
    from kvasir_rpc._channel import TunnelCipher, preferred_aeads
    from kvasir_rpc._checkpoint import (
        CHECKPOINT_HINT,
        CheckpointError,
        ExpertIndex,
        ModelInfo,
        SpecError,
        check_checkpoint,
        expert_digest,
        format_slices,
        parse_expert_spec,
        read_model_info,
        slices_digest,
    )
    from kvasir_rpc._cliargs import (
        BACKBONE_TOKEN_FILE,
        EXIT_INTERRUPTED,
        EXIT_USAGE,
        HUB_KEY_FILE,
        LOG_LEVELS,
        STATE_DIR,
        WALLET_FILE,
        HelpFormatter,
        add_log_level,
        fail,
        hostport,
        hostport_text,
        make_state_parent,
        run_main,
        write_ready_file,
    )
    from kvasir_rpc._codec import (
        DTYPE_TO_WIRE,
        decode_tensor,
        encode_tensor,
        encode_tensor_into,
        serialize_dispatch_request,
        serialize_dispatch_response,
    )
    from kvasir_rpc._errors import (
        CloseClass,
        CloseCode,
        LocalProtocolError,
        RemoteProtocolError,
        close_class,
        leaf_exception,
    )
    from kvasir_rpc._experts import ExpertSet, ModelShape, read_model_shape
    from kvasir_rpc._fastmask import install_fast_masking, xor_mask_into
    from kvasir_rpc._fetch import (
        DEFAULT_MODEL_CACHE,
        FetchError,
        FetchProgress,
        FetchResult,
        fetch_checkpoint,
        is_model_url,
        load_hf_token,
        model_cache_folder,
    )
    from kvasir_rpc._function import ExpertFunction, announced_mismatch, as_function, function_of_module
    from kvasir_rpc._gen.kvasir.v1 import (
        backbone_pb2,
        backbone_pb2_grpc,
        expert_pb2,
        expert_pb2_grpc,
        function_pb2,
        ledger_pb2,
        ledger_pb2_grpc,
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
    from kvasir_rpc._interceptor import NeverUnknown
    from kvasir_rpc._kernel import (
        Route,
        all_finite,
        expert_forward,
        expert_forward_projections,
        plan_routes,
        threads_initializer,
        validate_dispatch,
    )
    from kvasir_rpc._kv_cache import GrowingLayer, growing_cache
    from kvasir_rpc._lazy import lazy_getattr
    from kvasir_rpc._listen import (
        NO_PORT_SHARING,
        ListenError,
        as_listen_error,
        bind_grpc,
        check_listen,
    )
    from kvasir_rpc._log import (
        configure_logging,
        get_logger,
    )
    from kvasir_rpc._metrics import (
        LATENCY_BUCKETS_S,
        METRICS_PATH,
        StatsCollector,
        counter_family,
        gauge_family,
        latency_histogram,
        serve_metrics,
    )
    from kvasir_rpc._np_checkpoint import (
        NpExpert,
        NpExpertReader,
        dequantize_block_fp8_np,
        dequantize_mxfp4_np,
        fp8_e4m3_values,
        numpy_refusal,
        round_to_dtype,
    )
    from kvasir_rpc._np_kernel import (
        NP_ACTIVATIONS,
        check_function_np,
        expert_forward_np,
        set_blas_threads,
        torch_installed,
        validate_dispatch_np,
    )
    from kvasir_rpc._quant import (
        CT_COMPANIONS,
        CtExpert,
        Mxfp4Expert,
        QuantizedExpert,
        QuantizedWeights,
        compress_ct,
        ct_scheme_of,
        decompress_now,
        dequantize_block_fp8,
        dequantize_ct_dense,
        dequantize_mxfp4,
        quantize_block_fp8,
        quantize_ct_activations,
        quantize_mxfp4,
        write_ct_release,
        write_fp8_release,
        write_mxfp4_release,
    )
    from kvasir_rpc._receipts import (
        DEFAULT_RATE_NANO_PER_BYTE,
        MAX_CUMULATIVE_BYTES,
        ReceiptError,
        format_kvr,
        format_units,
        open_receipt,
        sign_receipt,
        validate_receipt,
    )
    from kvasir_rpc._reflection import enable_reflection, start_with_health
    from kvasir_rpc._row_checks import NARROW_Z, ROW_CHECK_FACTOR, RowChecker, RowVerdict
    from kvasir_rpc._segments import DispatchInputError, segment_order, segment_starts
    from kvasir_rpc._secrets import (
        check_secret_mode,
        ensure_state_dir,
        write_secret,
    )
    from kvasir_rpc._sockio import ReadBuffer, read_into, write_parts
    from kvasir_rpc._tls import TLSStream
    from kvasir_rpc._tolerance import TOLERANCE_FACTOR, AuditResult, audit_rows, error_scale
    from kvasir_rpc._tunnel import (
        SealedHeartbeat,
        keepalive,
        receive_message,
        send_whole,
    )
    from kvasir_rpc._wallet import (
        Wallet,
        WalletError,
        is_address,
        verify_signature,
    )
    from kvasir_rpc._wire import (
        WIRE_DTYPE_NAMES,
        TensorCodecError,
        bfloat16_bits,
        decode_array,
        serialize_array_response,
    )
    from kvasir_rpc._ws import (
        OWN_PING,
        SEND_TIMEOUT_S,
        BudgetStats,
        Held,
        MessageBudget,
        WebSocket,
        WsClosed,
        WsConnectTimeout,
        WsHandshakeError,
        WsRejected,
        WsStats,
        open_websocket,
    )
    from kvasir_rpc._ws_http import (
        MAX_HEADER_BYTES,
        HttpError,
        HttpRequest,
        accept_websocket,
        read_request,
        send_response,
    )

__version__ = "0.1.0"

_GEN = "kvasir_rpc._gen.kvasir.v1"
_LAZY = {
    "AUTHORIZATION_METADATA": "kvasir_rpc._access",
    "MIN_TOKEN_CHARS": "kvasir_rpc._access",
    "TARGET_KEY_METADATA": "kvasir_rpc._access",
    "TokenError": "kvasir_rpc._access",
    "bearer": "kvasir_rpc._access",
    "check_bearer": "kvasir_rpc._access",
    "load_or_create_token": "kvasir_rpc._access",
    "load_token": "kvasir_rpc._access",
    "target_key": "kvasir_rpc._access",
    "target_key_matches": "kvasir_rpc._access",
    "CloseCode": "kvasir_rpc._errors",
    "CloseClass": "kvasir_rpc._errors",
    "close_class": "kvasir_rpc._errors",
    "LocalProtocolError": "kvasir_rpc._errors",
    "RemoteProtocolError": "kvasir_rpc._errors",
    "leaf_exception": "kvasir_rpc._errors",
    "backbone_pb2": _GEN,
    "backbone_pb2_grpc": _GEN,
    "expert_pb2": _GEN,
    "expert_pb2_grpc": _GEN,
    "ledger_pb2": _GEN,
    "ledger_pb2_grpc": _GEN,
    "session_pb2": _GEN,
    "session_pb2_grpc": _GEN,
    "tensor_pb2": _GEN,
    "function_pb2": _GEN,
    "address_key": "kvasir_rpc._addr",
    "remote_host": "kvasir_rpc._addr",
    "ExpertSet": "kvasir_rpc._experts",
    "ModelShape": "kvasir_rpc._experts",
    "read_model_shape": "kvasir_rpc._experts",
    "HELLO_SIGNATURE_DOMAIN": "kvasir_rpc._handshake",
    "HelloInfo": "kvasir_rpc._handshake",
    "HubHandshake": "kvasir_rpc._handshake",
    "WorkerHandshake": "kvasir_rpc._handshake",
    "slices_from_proto": "kvasir_rpc._handshake",
    "slices_to_proto": "kvasir_rpc._handshake",
    "enable_reflection": "kvasir_rpc._reflection",
    "NeverUnknown": "kvasir_rpc._interceptor",
    "start_with_health": "kvasir_rpc._reflection",
    "NO_PORT_SHARING": "kvasir_rpc._listen",
    "ListenError": "kvasir_rpc._listen",
    "as_listen_error": "kvasir_rpc._listen",
    "bind_grpc": "kvasir_rpc._listen",
    "check_listen": "kvasir_rpc._listen",
    "check_secret_mode": "kvasir_rpc._secrets",
    "ensure_state_dir": "kvasir_rpc._secrets",
    "write_secret": "kvasir_rpc._secrets",
    "DEFAULT_RATE_NANO_PER_BYTE": "kvasir_rpc._receipts",
    "MAX_CUMULATIVE_BYTES": "kvasir_rpc._receipts",
    "ReceiptError": "kvasir_rpc._receipts",
    "format_kvr": "kvasir_rpc._receipts",
    "format_units": "kvasir_rpc._receipts",
    "open_receipt": "kvasir_rpc._receipts",
    "sign_receipt": "kvasir_rpc._receipts",
    "validate_receipt": "kvasir_rpc._receipts",
    "configure_logging": "kvasir_rpc._log",
    "get_logger": "kvasir_rpc._log",
    "Wallet": "kvasir_rpc._wallet",
    "WalletError": "kvasir_rpc._wallet",
    "is_address": "kvasir_rpc._wallet",
    "verify_signature": "kvasir_rpc._wallet",
    "hostport": "kvasir_rpc._cliargs",
    "hostport_text": "kvasir_rpc._cliargs",
    "BACKBONE_TOKEN_FILE": "kvasir_rpc._cliargs",
    "STATE_DIR": "kvasir_rpc._cliargs",
    "HUB_KEY_FILE": "kvasir_rpc._cliargs",
    "WALLET_FILE": "kvasir_rpc._cliargs",
    "make_state_parent": "kvasir_rpc._cliargs",
    "EXIT_INTERRUPTED": "kvasir_rpc._cliargs",
    "EXIT_USAGE": "kvasir_rpc._cliargs",
    "LOG_LEVELS": "kvasir_rpc._cliargs",
    "HelpFormatter": "kvasir_rpc._cliargs",
    "add_log_level": "kvasir_rpc._cliargs",
    "fail": "kvasir_rpc._cliargs",
    "run_main": "kvasir_rpc._cliargs",
    "write_ready_file": "kvasir_rpc._cliargs",
    "install_fast_masking": "kvasir_rpc._fastmask",
    "xor_mask_into": "kvasir_rpc._fastmask",
    "lazy_getattr": "kvasir_rpc._lazy",
    "DTYPE_TO_WIRE": "kvasir_rpc._codec",
    "TensorCodecError": "kvasir_rpc._wire",
    "WIRE_DTYPE_NAMES": "kvasir_rpc._wire",
    "bfloat16_bits": "kvasir_rpc._wire",
    "decode_array": "kvasir_rpc._wire",
    "serialize_array_response": "kvasir_rpc._wire",
    "encode_tensor": "kvasir_rpc._codec",
    "encode_tensor_into": "kvasir_rpc._codec",
    "serialize_dispatch_request": "kvasir_rpc._codec",
    "serialize_dispatch_response": "kvasir_rpc._codec",
    "decode_tensor": "kvasir_rpc._codec",
    "CHECKPOINT_HINT": "kvasir_rpc._checkpoint",
    "CheckpointError": "kvasir_rpc._checkpoint",
    "check_checkpoint": "kvasir_rpc._checkpoint",
    "ExpertIndex": "kvasir_rpc._checkpoint",
    "ModelInfo": "kvasir_rpc._checkpoint",
    "SpecError": "kvasir_rpc._checkpoint",
    "expert_digest": "kvasir_rpc._checkpoint",
    "format_slices": "kvasir_rpc._checkpoint",
    "parse_expert_spec": "kvasir_rpc._checkpoint",
    "read_model_info": "kvasir_rpc._checkpoint",
    "slices_digest": "kvasir_rpc._checkpoint",
    "DEFAULT_MODEL_CACHE": "kvasir_rpc._fetch",
    "FetchError": "kvasir_rpc._fetch",
    "FetchProgress": "kvasir_rpc._fetch",
    "FetchResult": "kvasir_rpc._fetch",
    "fetch_checkpoint": "kvasir_rpc._fetch",
    "is_model_url": "kvasir_rpc._fetch",
    "load_hf_token": "kvasir_rpc._fetch",
    "model_cache_folder": "kvasir_rpc._fetch",
    "QuantizedExpert": "kvasir_rpc._quant",
    "QuantizedWeights": "kvasir_rpc._quant",
    "Mxfp4Expert": "kvasir_rpc._quant",
    "dequantize_mxfp4": "kvasir_rpc._quant",
    "quantize_mxfp4": "kvasir_rpc._quant",
    "compress_ct": "kvasir_rpc._quant",
    "ct_scheme_of": "kvasir_rpc._quant",
    "write_mxfp4_release": "kvasir_rpc._quant",
    "dequantize_block_fp8": "kvasir_rpc._quant",
    "quantize_block_fp8": "kvasir_rpc._quant",
    "write_fp8_release": "kvasir_rpc._quant",
    "CT_COMPANIONS": "kvasir_rpc._quant",
    "CtExpert": "kvasir_rpc._quant",
    "dequantize_ct_dense": "kvasir_rpc._quant",
    "write_ct_release": "kvasir_rpc._quant",
    "quantize_ct_activations": "kvasir_rpc._quant",
    "decompress_now": "kvasir_rpc._quant",
    "expert_forward": "kvasir_rpc._kernel",
    "GrowingLayer": "kvasir_rpc._kv_cache",
    "growing_cache": "kvasir_rpc._kv_cache",
    "NARROW_Z": "kvasir_rpc._row_checks",
    "ROW_CHECK_FACTOR": "kvasir_rpc._row_checks",
    "RowChecker": "kvasir_rpc._row_checks",
    "RowVerdict": "kvasir_rpc._row_checks",
    "TOLERANCE_FACTOR": "kvasir_rpc._tolerance",
    "AuditResult": "kvasir_rpc._tolerance",
    "audit_rows": "kvasir_rpc._tolerance",
    "error_scale": "kvasir_rpc._tolerance",
    "expert_forward_projections": "kvasir_rpc._kernel",
    "segment_order": "kvasir_rpc._segments",
    "segment_starts": "kvasir_rpc._segments",
    "plan_routes": "kvasir_rpc._kernel",
    "Route": "kvasir_rpc._kernel",
    "get_activation": "kvasir_rpc._activation",
    "DispatchInputError": "kvasir_rpc._segments",
    "validate_dispatch": "kvasir_rpc._kernel",
    "Activation": "kvasir_rpc._activation",
    "ExpertFunction": "kvasir_rpc._function",
    "announced_mismatch": "kvasir_rpc._function",
    "as_function": "kvasir_rpc._function",
    "function_of_module": "kvasir_rpc._function",
    "all_finite": "kvasir_rpc._kernel",
    "NP_ACTIVATIONS": "kvasir_rpc._np_kernel",
    "check_function_np": "kvasir_rpc._np_kernel",
    "expert_forward_np": "kvasir_rpc._np_kernel",
    "set_blas_threads": "kvasir_rpc._np_kernel",
    "torch_installed": "kvasir_rpc._np_kernel",
    "validate_dispatch_np": "kvasir_rpc._np_kernel",
    "NpExpert": "kvasir_rpc._np_checkpoint",
    "NpExpertReader": "kvasir_rpc._np_checkpoint",
    "dequantize_block_fp8_np": "kvasir_rpc._np_checkpoint",
    "dequantize_mxfp4_np": "kvasir_rpc._np_checkpoint",
    "fp8_e4m3_values": "kvasir_rpc._np_checkpoint",
    "numpy_refusal": "kvasir_rpc._np_checkpoint",
    "round_to_dtype": "kvasir_rpc._np_checkpoint",
    "threads_initializer": "kvasir_rpc._kernel",
    "TLSStream": "kvasir_rpc._tls",
    "ReadBuffer": "kvasir_rpc._sockio",
    "read_into": "kvasir_rpc._sockio",
    "write_parts": "kvasir_rpc._sockio",
    "keepalive": "kvasir_rpc._tunnel",
    "SealedHeartbeat": "kvasir_rpc._tunnel",
    "send_whole": "kvasir_rpc._tunnel",
    "receive_message": "kvasir_rpc._tunnel",
    "TunnelCipher": "kvasir_rpc._channel",
    "preferred_aeads": "kvasir_rpc._channel",
    "MAX_HEADER_BYTES": "kvasir_rpc._ws_http",
    "HttpError": "kvasir_rpc._ws_http",
    "HttpRequest": "kvasir_rpc._ws_http",
    "accept_websocket": "kvasir_rpc._ws_http",
    "read_request": "kvasir_rpc._ws_http",
    "send_response": "kvasir_rpc._ws_http",
    "OWN_PING": "kvasir_rpc._ws",
    "SEND_TIMEOUT_S": "kvasir_rpc._ws",
    "BudgetStats": "kvasir_rpc._ws",
    "Held": "kvasir_rpc._ws",
    "MessageBudget": "kvasir_rpc._ws",
    "WebSocket": "kvasir_rpc._ws",
    "WsClosed": "kvasir_rpc._ws",
    "WsConnectTimeout": "kvasir_rpc._ws",
    "WsHandshakeError": "kvasir_rpc._ws",
    "WsRejected": "kvasir_rpc._ws",
    "WsStats": "kvasir_rpc._ws",
    "open_websocket": "kvasir_rpc._ws",
    "LATENCY_BUCKETS_S": "kvasir_rpc._metrics",
    "METRICS_PATH": "kvasir_rpc._metrics",
    "StatsCollector": "kvasir_rpc._metrics",
    "counter_family": "kvasir_rpc._metrics",
    "gauge_family": "kvasir_rpc._metrics",
    "latency_histogram": "kvasir_rpc._metrics",
    "serve_metrics": "kvasir_rpc._metrics",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvasir_rpc' has no attribute {name!r}")
    if module == _GEN:
        value: Any = importlib.import_module(f"{_GEN}.{name}")
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
