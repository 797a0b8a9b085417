"""kvasir.v1.BackboneService over gRPC: Generate (server streaming), ListModels, Describe,
with reflection (v1 and v1alpha) and health. The OpenAI-compatible HTTP API
(``_http.py``) serves the same ``Backbone`` (one engine, one batch)."""

from __future__ import annotations

import dataclasses
import hmac
import time
from concurrent import futures
from typing import Any

import grpc

from backbone._engine import (
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
from backbone._experts import Dispatcher
from kvasir_rpc import NO_PORT_SHARING, backbone_pb2, backbone_pb2_grpc, check_bearer, get_logger, start_with_health

log = get_logger("backbone.serve")

SERVICE_NAME = "kvasir.v1.BackboneService"
# How often a streaming handler looks whether its caller is still there while no token comes.
_POLL_S = 0.5

__all__ = ["SERVICE_NAME", "Backbone", "serve_backbone"]

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
            dtype=str(next(model.parameters()).dtype).replace("torch.", ""), created=self.created)

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

    def tokenize(self, prompt: str) -> tuple[int, ...]:
        return tuple(int(t) for t in self.tokenizer(prompt)["input_ids"])

    def request(self, *, prompt: str | None, prompt_ids: list[int] | tuple[int, ...] | None, max_tokens: int,
                sampling: Sampling, stop: tuple[str, ...] = (), ignore_eos: bool = False,
                digest_logits: bool = False) -> Request:
        """A checked engine Request (InvalidRequest names the field at fault)."""
        if prompt and prompt_ids:
            raise InvalidRequest("prompt", "give the prompt as text or as token ids, not both")
        ids = tuple(prompt_ids) if prompt_ids else self.tokenize(prompt or "")
        request = Request(prompt_ids=ids, max_tokens=max_tokens or DEFAULT_MAX_TOKENS, sampling=sampling,
                          stop=stop, ignore_eos=ignore_eos, digest_logits=digest_logits)
        self.engine.validate(request)
        return request


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

    def _authorize(self, context: grpc.ServicerContext) -> None:
        key = self.backbone.api_key
        if key and not check_bearer(context.invocation_metadata(), key):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "this backbone needs its API key: send 'authorization: Bearer KEY' metadata "
                          "(KEY is in the file given to --api-key-file)")

    def Generate(self, request: backbone_pb2.GenerateRequest, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        bb = self.backbone
        self._authorize(context)
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
        return backbone_pb2.ListModelsResponse(models=[self.backbone.card()])

    def Describe(self, request: backbone_pb2.BackboneServiceDescribeRequest,
                 context: grpc.ServicerContext) -> backbone_pb2.BackboneServiceDescribeResponse:
        self._authorize(context)
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


def serve_backbone(address: str, backbone: Backbone, *, extra_workers: int = 8) -> tuple[grpc.Server, int, Any]:
    """A started gRPC server with BackboneService, reflection and health on ``address``
    ("HOST:PORT", port 0 picks one): ``(server, port, health servicer)``. Every streaming
    call holds a thread, so the pool has one per slot and per waiting request (and a few
    more for ListModels, Describe and health); past that grpcio answers RESOURCE_EXHAUSTED."""
    engine = backbone.engine
    workers = engine.max_batch + engine.max_waiting + extra_workers
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="backbone-svc"),
                         options=[NO_PORT_SHARING], maximum_concurrent_rpcs=workers)
    backbone_pb2_grpc.add_BackboneServiceServicer_to_server(BackboneServicer(backbone), server)
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
