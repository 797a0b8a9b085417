"""The backbone service's Prometheus metrics (``kvasir_backbone_*``), served at ``/metrics`` of
its HTTP API. Counters are read at scrape time from what the engine and the dispatcher count
already (``Dispatcher.statistics()``, ``Backbone.describe()``); only the latency of remote
calls is observed as they are accepted. Nothing here holds a prompt or a token."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from backbone.service._grpc_api import Backbone
from kvasir_rpc import StatsCollector, counter_family, gauge_family, latency_histogram

__all__ = ["BackboneMetrics"]


class BackboneMetrics:
    """The registry of ``backbone``'s metrics. Creating it starts timing the dispatcher's
    accepted remote calls (``kvasir_backbone_expert_call_duration_seconds``)."""

    def __init__(self, backbone: Backbone) -> None:
        self._bb = backbone
        self.registry = CollectorRegistry()
        calls = latency_histogram(
            "kvasir_backbone_expert_call_duration_seconds",
            "round trip of each accepted remote expert call, from sent to answered", self.registry)
        backbone.dispatcher.observe_call = calls.observe
        self.registry.register(StatsCollector(self._families))

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)

    def _families(self) -> Iterator[Metric]:
        bb = self._bb
        engine = bb.engine
        d = bb.dispatcher.statistics()
        described = bb.describe()
        yield counter_family("kvasir_backbone_requests_total",
                             "requests by how they ended: length, eos, stop (finished), cancelled, aborted, "
                             "unavailable, internal (failed), overloaded (refused)",
                             labels={(k,): n for k, n in engine.outcomes().items()}, labelnames=("outcome",))
        yield counter_family("kvasir_backbone_tokens_generated_total", "tokens of finished requests",
                             engine.tokens_generated)
        yield gauge_family("kvasir_backbone_requests_running", "requests being decoded", described.running)
        yield gauge_family("kvasir_backbone_requests_waiting", "requests waiting for a slot", described.waiting)
        yield counter_family("kvasir_backbone_decode_steps_total", "decode steps (one token for every row)",
                             engine.decode_steps)
        yield counter_family("kvasir_backbone_decode_rows_total",
                             "rows stepped, over all decode steps (divided by the steps: the mean batch size)",
                             engine.decode_rows)
        yield gauge_family("kvasir_backbone_live_sessions", "worker sessions the hub lists", described.live_sessions)
        yield gauge_family("kvasir_backbone_expert_coverage_ratio", "share of the experts some live worker holds",
                           described.coverage)
        yield gauge_family("kvasir_backbone_expert_held_bytes", "expert weights held here", d.expert_bytes_held)
        yield counter_family("kvasir_backbone_remote_calls_total", "remote expert calls answered and accepted",
                             d.remote_calls)
        yield counter_family("kvasir_backbone_remote_rows_total", "expert rows computed by workers and accepted",
                             d.remote_rows)
        yield counter_family("kvasir_backbone_local_rows_total", "expert rows computed here by choice", d.local_rows)
        yield counter_family("kvasir_backbone_fallback_calls_total",
                             "remote calls lost, refused or timed out, computed here instead", d.fallback_calls)
        yield counter_family("kvasir_backbone_fallback_rows_total", "rows of the fallback calls", d.fallback_rows)
        yield counter_family("kvasir_backbone_worker_busy_refusals_total",
                             "links a worker turned away because it served its maximum of backbones at once "
                             "(its experts computed here until a retry gets in)", d.worker_busy_refusals)
        yield counter_family("kvasir_backbone_hedged_calls_total",
                             "remote calls past their deadline, computed here while their answer was still due",
                             d.hedged_calls)
        yield counter_family("kvasir_backbone_hedged_rows_total", "rows of the hedged calls", d.hedged_rows)
        yield counter_family("kvasir_backbone_late_answers_dropped_total",
                             "answers of hedged calls that came after all (unused, unpaid)", d.late_answers_dropped)
        yield counter_family("kvasir_backbone_worker_sent_bytes_total", "serialized requests sent to workers",
                             d.sent_bytes)
        yield counter_family("kvasir_backbone_worker_received_bytes_total",
                             "serialized partials received from workers in time", d.received_bytes)
        yield counter_family("kvasir_backbone_audited_rows_total", "rows of accepted answers recomputed here",
                             d.audited_rows)
        yield counter_family("kvasir_backbone_audit_exact_rows_total", "audited rows that matched bit for bit",
                             d.audit_exact_rows)
        yield counter_family("kvasir_backbone_audit_seconds_total", "CPU time spent recomputing audited rows",
                             d.audit_seconds)
        yield counter_family("kvasir_backbone_answers_refused_total",
                             "answers that failed their check or audit (the session is quarantined)",
                             d.answers_refused)
        yield counter_family("kvasir_backbone_row_checked_rows_total",
                             "answer rows checked by the row checks before use (every row of a row-checked session)",
                             d.row_checked_rows)
        yield counter_family("kvasir_backbone_row_check_refusals_total",
                             "answers refused by their row checks (computed here instead)", d.row_check_refusals)
        yield counter_family("kvasir_backbone_sessions_quarantined_total",
                             "sessions caught delivering wrong work, never routed to again",
                             len(d.sessions_quarantined))
        yield counter_family("kvasir_backbone_replays_total", "decodes replayed without a quarantined session",
                             d.replays)
        yield counter_family("kvasir_backbone_shared_overlapped_total",
                             "shared-expert computations overlapped with remote calls", d.shared_overlapped)
