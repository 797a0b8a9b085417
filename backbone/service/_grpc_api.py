"""kvasir.v1.BackboneService over gRPC: Generate (server streaming), ListModels, Describe,
with reflection (v1 and v1alpha) and health. The OpenAI-compatible HTTP API
(``_http_api.py``) serves the same ``Backbone`` (one engine, one batch).

What a caller sends is bounded before any work is done on it: a prompt's text by its size in
UTF-8 bytes before it is tokenized (``Backbone.max_prompt_bytes``), a whole gRPC message by
grpc itself (``max_message_bytes``), and a request whose strings are not UTF-8 gets
INVALID_ARGUMENT naming the field, where grpcio would answer INTERNAL."""

from __future__ import annotations

import dataclasses
import hmac
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf import empty_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from backbone.engine._batch import (
    DEFAULT_MAX_TOKENS,
    Engine,
    Finish,
    InvalidRequest,
    Overloaded,
    Request,
    RequestStream,
    Sampling,
    Summary,
)
from backbone.experts._dispatch import Dispatcher
from kvasir_rpc import (
    NO_PORT_SHARING,
    ExpertFunction,
    NeverUnknown,
    backbone_pb2,
    backbone_pb2_grpc,
    check_bearer,
    get_logger,
    start_with_health,
)

log = get_logger("backbone.serve")

SERVICE_NAME = "kvasir.v1.BackboneService"
# How often a streaming handler looks whether its caller is still there while no token comes.
_POLL_S = 0.5

__all__ = ["GRPC_DEFAULT_MESSAGE_BYTES", "PROMPT_BYTES_CAP", "PROMPT_BYTES_PER_TOKEN", "SERVICE_NAME", "Backbone",
           "Undecodable", "decode_request", "default_max_prompt_bytes", "max_message_bytes", "serve_backbone"]

# A prompt's text is refused before it is tokenized when its UTF-8 is larger than this many
# bytes per token of the model's context: text that long cannot fit (prose and code run a few
# bytes a token). Tokenizing costs time and memory in proportion to the text, and the allocator
# keeps much of that memory, so the default never exceeds PROMPT_BYTES_CAP whatever the
# context; `backbone serve --max-prompt-bytes` sets another limit.
PROMPT_BYTES_PER_TOKEN = 16
PROMPT_BYTES_CAP = 2 << 20
# grpcio's own default largest message. A message up to the larger of this and what a valid
# request may take reaches the handler (an oversized prompt gets INVALID_ARGUMENT naming the
# limit); a larger one grpc refuses (RESOURCE_EXHAUSTED) before it is read.
GRPC_DEFAULT_MESSAGE_BYTES = 4 << 20
# The most one prompt token id takes in a GenerateRequest (a uint32 varint), and room for
# the other fields (stop strings, sampling, model).
_TOKEN_ID_BYTES = 5
_OTHER_FIELDS_BYTES = 64 << 10

_FINISH = {Finish.LENGTH: backbone_pb2.FINISH_REASON_LENGTH, Finish.EOS: backbone_pb2.FINISH_REASON_EOS,
           Finish.STOP: backbone_pb2.FINISH_REASON_STOP}

_ERROR_CODES = {"aborted": grpc.StatusCode.ABORTED, "unavailable": grpc.StatusCode.UNAVAILABLE,
                "internal": grpc.StatusCode.INTERNAL}


@dataclasses.dataclass
class Backbone:
    """The served model: its engine and what ListModels/Describe say about it."""

    engine: Engine
    tokenizer: Any
    dispatcher: Dispatcher
    model_id: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # When set, callers present it as a bearer token (gRPC metadata, HTTP Authorization).
    api_key: str = ""
    # The largest prompt text, in UTF-8 bytes, that is tokenized; 0: default_max_prompt_bytes.
    max_prompt_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_prompt_bytes <= 0:
            self.max_prompt_bytes = default_max_prompt_bytes(self.engine.context_length)

    def key_presented(self, presented: str | None) -> bool:
        """Whether ``presented`` (the token after "Bearer ") opens the service, in constant time."""
        if not self.api_key:
            return True
        return hmac.compare_digest((presented or "").encode(), self.api_key.encode())

    def card(self) -> backbone_pb2.ModelCard:
        model = self.engine.model
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        weights = self.dispatcher.weights
        layers = weights.layers()
        return backbone_pb2.ModelCard(
            id=self.model_id, architecture=str(getattr(model.config, "model_type", "")),
            context_length=self.engine.context_length, layers=int(getattr(config, "num_hidden_layers", 0) or 0),
            experts_per_layer=max((weights.num_experts(layer) or 0 for layer in layers), default=0),
            experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0),
            dtype=str(next(model.parameters()).dtype).replace("torch.", ""), created=self.created,
            expert_functions=_functions_by_layer(weights.functions))

    def describe(self) -> backbone_pb2.BackboneServiceDescribeResponse:
        weights = self.dispatcher.weights
        placement = self.dispatcher.placement
        covered, live = placement.coverage() if placement is not None else ({}, 0)
        layers = []
        total = hit = 0
        for layer in weights.layers():
            n = weights.num_experts(layer) or 0
            mine = sorted(e for e in covered.get(layer, ()) if e < n)
            layers.append(backbone_pb2.LayerCoverage(layer=layer, experts=n, covered=mine))
            total += n
            hit += len(mine)
        running, waiting = self.engine.load()
        return backbone_pb2.BackboneServiceDescribeResponse(
            model=self.card(), layers=layers, coverage=hit / total if total else 0.0, live_sessions=live,
            running=running, waiting=waiting, max_batch_size=self.engine.max_batch,
            max_waiting=self.engine.max_waiting, remote=placement is not None, stats=self.stats())

    def stats(self) -> backbone_pb2.ExpertPathStats:
        d = self.dispatcher.statistics()
        return backbone_pb2.ExpertPathStats(
            remote_calls=d.remote_calls, remote_rows=d.remote_rows, local_rows=d.local_rows,
            fallback_calls=d.fallback_calls, fallback_rows=d.fallback_rows, hedged_calls=d.hedged_calls,
            audited_rows=d.audited_rows, audit_exact_rows=d.audit_exact_rows,
            sessions_quarantined=d.sessions_quarantined, replays=d.replays,
            requests_finished=self.engine.requests_finished, tokens_generated=self.engine.tokens_generated,
            sessions_used=d.sessions_used, shared_overlapped=d.shared_overlapped)

    def check_model(self, name: str) -> None:
        """InvalidRequest("model") unless ``name`` is empty or this model's id."""
        if name and name != self.model_id:
            raise InvalidRequest("model", f"{name!r} is not served here; this backbone serves {self.model_id!r}")

    def check_prompt_bytes(self, field: str, texts: Sequence[str]) -> None:
        """InvalidRequest(``field``) when ``texts`` together are more than ``max_prompt_bytes``
        in UTF-8: called before they are tokenized. Counts a lone surrogate as UTF-8 would
        hold it (3 bytes) rather than failing on it."""
        size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
        if size > self.max_prompt_bytes:
            raise InvalidRequest(field, f"{size} bytes of UTF-8 text, more than this backbone's limit of "
                                        f"{self.max_prompt_bytes} bytes; shorten it (the limit is "
                                        "`python -m backbone serve --max-prompt-bytes`, by default "
                                        f"{PROMPT_BYTES_PER_TOKEN} bytes per token of the model's context)")

    def tokenize(self, prompt: str) -> tuple[int, ...]:
        return tuple(int(t) for t in self.tokenizer(prompt)["input_ids"])

    def request(self, *, prompt: str | None, prompt_ids: list[int] | tuple[int, ...] | None, max_tokens: int,
                sampling: Sampling, stop: tuple[str, ...] = (), ignore_eos: bool = False,
                digest_logits: bool = False) -> Request:
        """A checked engine Request (InvalidRequest names the field at fault). A text prompt
        over ``max_prompt_bytes`` is refused before it is tokenized."""
        if prompt and prompt_ids:
            raise InvalidRequest("prompt", "give the prompt as text or as token ids, not both")
        if prompt:
            self.check_prompt_bytes("prompt", (prompt,))
        ids = tuple(prompt_ids) if prompt_ids else self.tokenize(prompt or "")
        request = Request(prompt_ids=ids, max_tokens=max_tokens or DEFAULT_MAX_TOKENS, sampling=sampling,
                          stop=stop, ignore_eos=ignore_eos, digest_logits=digest_logits)
        self.engine.validate(request)
        return request


def default_max_prompt_bytes(context_length: int) -> int:
    """The largest prompt text, in UTF-8 bytes, a backbone of ``context_length`` tokens
    tokenizes by default: PROMPT_BYTES_PER_TOKEN a token, at most PROMPT_BYTES_CAP."""
    return min(PROMPT_BYTES_PER_TOKEN * max(1, context_length), PROMPT_BYTES_CAP)


def max_message_bytes(max_prompt_bytes: int, context_length: int) -> int:
    """The largest gRPC message the service reads: any valid GenerateRequest (its prompt text
    or a whole context of prompt_token_ids, and the other fields) fits, and so does anything
    up to grpcio's usual limit, so that an oversized prompt gets the handler's precise
    INVALID_ARGUMENT; grpc refuses anything larger before it is read."""
    needed = max_prompt_bytes + _TOKEN_ID_BYTES * context_length + _OTHER_FIELDS_BYTES
    return max(GRPC_DEFAULT_MESSAGE_BYTES, needed)


# -- requests that do not parse ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Undecodable:
    """A request message that did not parse, and why (a message that starts with the field at
    fault when one is), to be answered INVALID_ARGUMENT."""

    reason: str


M = TypeVar("M", bound=Message)


def decode_request(cls: type[M], data: bytes) -> M | Undecodable:
    """``data`` parsed as ``cls``, or Undecodable. The protobuf runtime refuses a string
    field that is not UTF-8 (such as a lone surrogate a client encoded anyway); grpcio turns
    a deserializer's exception into INTERNAL, so the handlers get this instead."""
    try:
        return cls.FromString(data)
    except DecodeError:
        return Undecodable(_why_undecodable(cls.DESCRIPTOR, data))


def _why_undecodable(descriptor: Any, data: bytes) -> str:  # a Descriptor, Python or upb
    name = descriptor.full_name
    try:
        # Every field unknown to Empty: the wire format is read with no check of the strings.
        fields = UnknownFieldSet(empty_pb2.Empty.FromString(data))
    except DecodeError:
        return f"the request is not a {name}: its bytes are not protobuf wire format"
    seen: dict[int, int] = {}
    for i in range(len(fields)):
        unknown = fields[i]
        number = unknown.field_number
        index = seen[number] = seen.get(number, -1) + 1
        field = descriptor.fields_by_number.get(number)
        if field is None or field.type != FieldDescriptor.TYPE_STRING or not isinstance(unknown.data, bytes):
            continue
        try:
            unknown.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            where = f"{field.name}[{index}]" if field.is_repeated else field.name
            return (f"{where}: is not UTF-8 (byte {exc.start}: {exc.reason}); protobuf strings must be valid "
                    "UTF-8, and a lone UTF-16 surrogate (such as U+D800) is no character: send the text "
                    "encoded as UTF-8")
    return f"the request is not a valid {name}: a field's bytes do not parse as its type in backbone.proto"


def summary_message(s: Summary) -> backbone_pb2.GenerateSummary:
    msg = backbone_pb2.GenerateSummary(
        finish_reason=_FINISH[s.finish], stop=s.stop, prompt_tokens=s.prompt_tokens,
        completion_tokens=s.completion_tokens, queue_seconds=s.queue_seconds,
        time_to_first_token_seconds=s.time_to_first_token_seconds, total_seconds=s.total_seconds,
        tokens_per_second=s.tokens_per_second, remote_rows=s.remote_rows, local_rows=s.local_rows,
        fallback_rows=s.fallback_rows, max_batch_size=s.max_batch_size, logits_digest=s.logits_digest)
    if s.seed is not None:
        msg.seed = s.seed
    return msg


class BackboneServicer(backbone_pb2_grpc.BackboneServiceServicer):
    def __init__(self, backbone: Backbone) -> None:
        self.backbone = backbone

    @staticmethod
    def _check_decoded(request: object, context: grpc.ServicerContext) -> None:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)

    def _authorize(self, context: grpc.ServicerContext) -> None:
        key = self.backbone.api_key
        if key and not check_bearer(context.invocation_metadata(), key):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "this backbone needs its API key: send 'authorization: Bearer KEY' metadata "
                          "(KEY is in the file given to --api-key-file)")

    def Generate(self, request: backbone_pb2.GenerateRequest, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        bb = self.backbone
        self._authorize(context)
        self._check_decoded(request, context)
        try:
            bb.check_model(request.model)
            s = request.sampling
            sampling = Sampling(temperature=s.temperature, top_p=s.top_p if s.top_p else 1.0, top_k=s.top_k,
                                seed=s.seed if s.HasField("seed") else None)
            req = bb.request(prompt=request.prompt, prompt_ids=list(request.prompt_token_ids),
                             max_tokens=request.max_tokens, sampling=sampling, stop=tuple(request.stop),
                             ignore_eos=request.ignore_eos, digest_logits=request.digest_logits)
            stream = bb.engine.submit(req)
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.NOT_FOUND if exc.field == "model" else grpc.StatusCode.INVALID_ARGUMENT,
                          str(exc))
        except Overloaded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        # A caller that goes away (cancels, disconnects, passes its deadline) frees its slot now.
        context.add_callback(stream.cancel)
        yield from _messages(stream, context)

    def ListModels(self, request: backbone_pb2.ListModelsRequest,
                   context: grpc.ServicerContext) -> backbone_pb2.ListModelsResponse:
        self._authorize(context)
        self._check_decoded(request, context)
        return backbone_pb2.ListModelsResponse(models=[self.backbone.card()])

    def Describe(self, request: backbone_pb2.BackboneServiceDescribeRequest,
                 context: grpc.ServicerContext) -> backbone_pb2.BackboneServiceDescribeResponse:
        self._authorize(context)
        self._check_decoded(request, context)
        try:
            self.backbone.check_model(request.model)
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return self.backbone.describe()


def _messages(stream: RequestStream, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
    try:
        while True:
            event = stream.get(timeout=_POLL_S)
            if event is None:
                if not context.is_active():
                    return
                continue
            if event.error is not None:
                context.abort(_ERROR_CODES.get(event.error_kind, grpc.StatusCode.INTERNAL), event.error)
            msg = backbone_pb2.GenerateResponse(token_ids=event.token_ids, text=event.text)
            if event.summary is not None:
                msg.summary.CopyFrom(summary_message(event.summary))
            yield msg
            if event.last:
                return
    finally:
        stream.cancel()  # no-op once finished


def _add_servicer(servicer: BackboneServicer, server: grpc.Server) -> None:
    """What ``backbone_pb2_grpc.add_BackboneServiceServicer_to_server`` does, with requests
    parsed by decode_request (a request that does not parse reaches the handler, which
    answers INVALID_ARGUMENT)."""
    pb = backbone_pb2

    def decoder(cls: type[M]) -> Callable[[bytes], M | Undecodable]:
        return lambda data: decode_request(cls, data)

    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=decoder(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=decoder(pb.ListModelsRequest),
            response_serializer=pb.ListModelsResponse.SerializeToString),
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe, request_deserializer=decoder(pb.BackboneServiceDescribeRequest),
            response_serializer=pb.BackboneServiceDescribeResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # type: ignore[attr-defined]


def serve_backbone(address: str, backbone: Backbone, *, extra_workers: int = 8) -> tuple[grpc.Server, int, Any]:
    """A started gRPC server with BackboneService, reflection and health on ``address``
    ("HOST:PORT", port 0 picks one): ``(server, port, health servicer)``. Every streaming
    call holds a thread, so the pool has one per slot and per waiting request (and a few
    more for ListModels, Describe and health); past that grpcio answers RESOURCE_EXHAUSTED.
    A message over ``max_message_bytes`` is refused by grpc (RESOURCE_EXHAUSTED) unread;
    what a handler lets out is answered by NeverUnknown (never UNKNOWN)."""
    engine = backbone.engine
    workers = engine.max_batch + engine.max_waiting + extra_workers
    limit = max_message_bytes(backbone.max_prompt_bytes, engine.context_length)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="backbone-svc"),
                         interceptors=[NeverUnknown()],
                         options=[NO_PORT_SHARING, ("grpc.max_receive_message_length", limit)],
                         maximum_concurrent_rpcs=workers)
    _add_servicer(BackboneServicer(backbone), server)
    port, health_servicer = start_with_health(server, address, SERVICE_NAME)

    def on_health(serving: bool) -> None:  # an engine lane failed (restarting), or all step again
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        health_servicer.set(SERVICE_NAME, status)
        health_servicer.set("", status)

    engine.on_health = on_health
    if not engine.serving():
        on_health(False)
    return server, port, health_servicer


def _functions_by_layer(functions: Mapping[int, ExpertFunction]) -> list[Any]:
    """The model's expert functions, each with the MoE layers it is for (ascending)."""
    layers: dict[ExpertFunction, list[int]] = {}
    for layer, fn in sorted(functions.items()):
        layers.setdefault(fn, []).append(layer)
    return [fn.to_proto(tuple(ls)) for fn, ls in layers.items()]
