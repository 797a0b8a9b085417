"""Continuous batching: many callers' decodes in one running batch.

Requests join the batch as they arrive and leave as they finish; a cancelled one leaves
at the next step. Each request is prefilled alone (its prompt, its own cache), so its
first token never waits for a longer prompt's; then its cache joins the running batch
(left-padded to the batch's length) and every step decodes one token for every row.
The batch is split into ``lanes`` (micro-batch pipelining): each lane is its own batch on
its own thread, so one computes while another waits on remote experts.

Every row's numbers are its own: the padding is masked, each row has its own position
ids and its own random generator, so a greedy request returns the tokens it returns
alone (tests/test_serve.py checks 32 at once). Expert rows are tallied by request, so
each summary tells where its own rows ran.

Each lane has its decode attempt (``_attempt.py``). A worker caught in a pass's audits
makes the lane recompute that pass without it (the cache cut back to its length before the
pass); a session whose earlier answers can no longer be trusted makes it recompute every row
from its prompt, checking that the tokens already sent were right (a request whose sent tokens
the liar had changed ends with an error: the text sent was wrong). Neither fails a request:
past a few replays the experts concerned are computed here.

A lane never dies silently: a failed step ends its own requests with an error and the lane
goes on; a failure of the lane's loop itself ends its requests, marks the engine unhealthy
(``serving()``, which the service's health check reports) and restarts the loop after a
backoff, healthy again once it steps.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from backbone.experts._attempt import DecodeAttempt, ReplayNeeded
from backbone.experts._dispatch import IMPLEMENTATION, Dispatcher
from kvasir_rpc import get_logger, threads_initializer

T = TypeVar("T")

log = get_logger("backbone.engine")

__all__ = ["Engine", "Finish", "InvalidRequest", "Overloaded", "Request", "RequestStream", "Sampling",
           "StreamEvent", "Summary"]

DEFAULT_MAX_TOKENS = 16
MAX_STOPS = 8
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 100.0
# A lane whose loop failed is restarted after this long, doubled for each failure in the
# last minute, at most RESTART_MAX_S.
RESTART_BACKOFF_S = 0.25
RESTART_MAX_S = 30.0
# Tokens (padding included) of one pass that prefills several prompts together.
PREFILL_TOKENS = 4096


class InvalidRequest(ValueError):
    """A request that cannot be served; ``field`` names the part at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Overloaded(RuntimeError):
    """Every slot and the waiting line are full."""


class Finish(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    digest_logits: bool = False  # SHA-256 of every step's float32 logits, in the summary


@dataclasses.dataclass(frozen=True)
class Summary:
    finish: Finish
    stop: str
    prompt_tokens: int
    completion_tokens: int
    queue_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float
    tokens_per_second: float
    remote_rows: int
    local_rows: int
    fallback_rows: int
    max_batch_size: int
    seed: int | None
    logits_digest: bytes = b""


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """New tokens and text; or the summary (last); or an error (last)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    summary: Summary | None = None
    error: str | None = None  # what went wrong, for a person; the stream ends with it
    # "aborted": a worker's wrong work changed tokens already sent; "unavailable": shutting
    # down; "internal": the decode failed.
    error_kind: str = ""

    @property
    def last(self) -> bool:
        return self.summary is not None or self.error is not None


class RequestStream:
    """What one request produces, for the caller's thread: iterate it, or ``get`` with a
    timeout. ``cancel`` frees the request's slot at the engine's next step."""

    def __init__(self, engine: Engine, request: Request) -> None:
        self.request = request
        self._engine = engine
        self._events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()
        self._listeners: list[Callable[[], None]] = []
        self.cancelled = False
        self.finished = False

    def get(self, timeout: float | None = None) -> StreamEvent | None:
        """The next event, or None after ``timeout`` seconds without one."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def __iter__(self) -> Iterator[StreamEvent]:
        while True:
            event = self._events.get()
            yield event
            if event.last:
                return

    def add_listener(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called (from the engine's thread, must not block) after each event."""
        self._listeners.append(wake)
        if not self._events.empty():
            wake()

    def cancel(self) -> None:
        if not self.cancelled and not self.finished:
            self.cancelled = True
            self._engine._ended("cancelled")
            self._engine._wake()

    def _put(self, event: StreamEvent) -> None:
        if event.last:
            if not self.finished and not self.cancelled:
                self._engine._ended(event.summary.finish.value if event.summary is not None
                                    else event.error_kind or "internal")
            self.finished = True
        self._events.put(event)
        for wake in list(self._listeners):
            try:
                wake()
            except Exception:  # a listener's failure (its loop closed) is the caller's business
                log.debug("stream listener failed", exc_info=True)


class _Seq:
    """One request in a lane."""

    def __init__(self, stream: RequestStream, eos: frozenset[int], arrived: float) -> None:
        self.stream = stream
        self.req = stream.request
        self.eos = frozenset() if self.req.ignore_eos else eos
        self.arrived = arrived
        self.admitted = 0.0
        self.first = 0.0
        self.delivered: list[int] = []  # token ids sent to the caller
        self.sent_chars = 0
        self.next_token = 0  # the last token chosen, the next step's input
        self.rows = [0, 0, 0]  # remote, local, fallback
        self.max_batch = 1
        seed = self.req.sampling.seed
        if seed is None and not self.req.sampling.greedy:
            seed = int(torch.randint(0, 2**63 - 1, (1,)).item())
        self.seed = seed
        self.restart()

    def restart(self) -> list[int]:
        """Back to the prompt (a fresh start, or a replay): no token generated, the generator
        at its seed, the digest empty. Returns the tokens sent so far."""
        self.generated: list[int] = []
        self.generator = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        self.digest = hashlib.sha256() if self.req.digest_logits else None
        return list(self.delivered)


class Engine:
    """Serves ``Request``s on ``model`` through ``dispatcher`` (remote experts, or local
    when the dispatcher has no hub). Thread-safe; ``close`` stops it."""

    def __init__(self, model, tokenizer, dispatcher: Dispatcher, *, max_batch: int = 32,  # type: ignore[no-untyped-def]
                 max_waiting: int = 64, lanes: int = 1, max_tokens_cap: int | None = None) -> None:
        if max_batch < 1 or max_waiting < 0 or lanes < 1:
            raise ValueError("max_batch and lanes must be at least 1, max_waiting at least 0")
        self.model, self.tokenizer, self.dispatcher = model, tokenizer, dispatcher
        model.set_experts_implementation(IMPLEMENTATION)
        self.max_batch, self.max_waiting = max_batch, max_waiting
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or 4096
        self.max_tokens_cap = max_tokens_cap or self.context_length
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos: frozenset[int] = frozenset([eos] if isinstance(eos, int) else (eos or []))
        # Several prompts are prefilled in one pass, left-padded, unless the cache has
        # linear-attention states (padding would run through them): those are prefilled alone.
        self.batchable, self.pad_prefill, why = _cache_layout(model)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad or 0)
        if not self.batchable:
            log.warning("this model's cache cannot be batched across requests; each lane decodes one at a time",
                        reason=why)
        self._cond = threading.Condition()
        self.requests_finished = self.tokens_generated = 0
        # Requests by how they ended (a Finish value, "cancelled", an error kind, "overloaded")
        # and decode steps with the rows they stepped, for metrics.
        self._counts_lock = threading.Lock()
        self._outcomes: dict[str, int] = {}
        self.decode_steps = self.decode_rows = 0
        self._waiting: list[_Seq] = []
        self._closed = False
        # Called with False when a lane's loop failed (it restarts after a backoff) and with
        # True when every lane steps again: the service's health check.
        self.on_health: Callable[[bool], None] | None = None
        self.lane_restarts = 0
        self._lanes = [_Lane(self, i) for i in range(lanes)]
        for lane in self._lanes:
            lane.thread.start()

    # -- callers ---------------------------------------------------------------------

    def submit(self, request: Request) -> RequestStream:
        """Queue ``request``; raises InvalidRequest or Overloaded (nothing is queued then)."""
        self.validate(request)
        stream = RequestStream(self, request)
        with self._cond:
            if self._closed:
                raise Overloaded("the backbone is shutting down")
            if self._running() + len(self._waiting) >= self.max_batch + self.max_waiting:
                self._ended("overloaded")
                raise Overloaded(f"all {self.max_batch} slots are busy and {len(self._waiting)} requests are "
                                 "waiting; retry later")
            self._waiting.append(_Seq(stream, self.eos, time.perf_counter()))
            self._cond.notify_all()
        return stream

    def validate(self, request: Request) -> None:
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequest("prompt", "is empty: give a prompt or prompt_token_ids")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest("prompt_token_ids", f"token id {bad[0]} is outside the vocabulary "
                                                     f"(0 to {self.vocab_size - 1})")
        if request.max_tokens < 1:
            raise InvalidRequest("max_tokens", "must be at least 1")
        if request.max_tokens > self.max_tokens_cap:
            raise InvalidRequest("max_tokens", f"{request.max_tokens} is more than this backbone's limit of "
                                               f"{self.max_tokens_cap}")
        if n >= self.context_length:
            raise InvalidRequest("prompt", f"is {n} tokens; the model's context is {self.context_length}")
        if n + request.max_tokens > self.context_length:
            raise InvalidRequest("max_tokens", f"the prompt ({n} tokens) plus max_tokens ({request.max_tokens}) "
                                               f"is more than the model's context of {self.context_length}; "
                                               f"at most {self.context_length - n}")
        s = request.sampling
        if not (math.isfinite(s.temperature) and 0.0 <= s.temperature <= MAX_TEMPERATURE):
            raise InvalidRequest("sampling.temperature", f"must be from 0 (greedy) to {MAX_TEMPERATURE:g}, "
                                                         f"got {s.temperature}")
        if not (math.isfinite(s.top_p) and 0.0 <= s.top_p <= 1.0):
            raise InvalidRequest("sampling.top_p", f"must be from 0 to 1, got {s.top_p}")
        if s.top_k < 0:
            raise InvalidRequest("sampling.top_k", f"must be 0 (off) or positive, got {s.top_k}")
        if s.seed is not None and not 0 <= s.seed < 2**64:
            raise InvalidRequest("sampling.seed", "must be from 0 to 2^64 - 1")
        if len(request.stop) > MAX_STOPS:
            raise InvalidRequest("stop", f"at most {MAX_STOPS} stop strings, got {len(request.stop)}")
        for i, stop in enumerate(request.stop):
            if not 1 <= len(stop) <= MAX_STOP_CHARS:
                raise InvalidRequest(f"stop[{i}]", f"must be 1 to {MAX_STOP_CHARS} characters, got {len(stop)}")

    def _finished(self, tokens: int) -> None:
        with self._cond:
            self.requests_finished += 1
            self.tokens_generated += tokens

    def _ended(self, outcome: str) -> None:
        with self._counts_lock:
            self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1

    def _stepped(self, rows: int) -> None:
        with self._counts_lock:
            self.decode_steps += 1
            self.decode_rows += rows

    def outcomes(self) -> dict[str, int]:
        """Requests so far by how they ended: "length", "eos", "stop" (finished), "cancelled"
        (the caller went away), "aborted", "unavailable", "internal" (failed), "overloaded"
        (refused at submit)."""
        with self._counts_lock:
            return dict(self._outcomes)

    def _running(self) -> int:
        return sum(len(lane.rows) + len(lane.joining) for lane in self._lanes)

    def serving(self) -> bool:
        """Whether every lane is running (none failed and waiting to restart) and the engine
        is open."""
        with self._cond:
            return not self._closed and all(lane.healthy for lane in self._lanes)

    def _lane_failed(self, lane: _Lane) -> bool:
        """``lane``'s loop failed: mark it unhealthy and wait its backoff (doubled for each
        failure in the last minute). False when the engine closed meanwhile."""
        now = time.monotonic()
        with self._cond:
            lane.failures.append(now)
            while lane.failures and lane.failures[0] < now - 60.0:
                lane.failures.popleft()
            self.lane_restarts += 1
            was, lane.healthy = self.serving(), False
            delay = min(RESTART_MAX_S, RESTART_BACKOFF_S * 2 ** (len(lane.failures) - 1))
        if was:
            self._health_changed(False)
        with self._cond:
            self._cond.wait_for(lambda: self._closed, timeout=delay)
            return not self._closed

    def _lane_ok(self, lane: _Lane) -> None:
        """``lane`` stepped: healthy again if it was not."""
        if lane.healthy:
            return
        with self._cond:
            lane.healthy = True
            now = self.serving()
        if now:
            self._health_changed(True)

    def _health_changed(self, serving: bool) -> None:
        log.warning("engine health changed", serving=serving)
        if self.on_health is not None:
            try:
                self.on_health(serving)
            except Exception:  # the listener's failure must not stop a lane
                log.exception("health listener failed")

    def load(self) -> tuple[int, int]:
        """``(running, waiting)``."""
        with self._cond:
            return self._running(), len(self._waiting)

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._cond.notify_all()
        for seq in waiting:
            seq.stream._put(StreamEvent(error="the backbone is shutting down", error_kind="unavailable"))
        for lane in self._lanes:
            lane.thread.join(timeout)

    # -- lanes -----------------------------------------------------------------------

    def _capacity(self, lane: _Lane) -> int:
        per_lane = max(1, -(-self.max_batch // len(self._lanes)))
        return per_lane if self.batchable else 1

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _take(self, lane: _Lane) -> list[_Seq]:
        """The waiting requests ``lane`` admits now, after blocking while it has nothing to
        do; empty when it should just step (or the engine closed). Lock held."""
        while not self._closed:
            self._waiting = [s for s in self._waiting if not self._drop_cancelled(s)]
            room = self._capacity(lane) - len(lane.rows)
            if room > 0 and self._waiting:
                # The least-loaded lane with room takes first, so lanes stay balanced.
                mine = len(lane.rows)
                if all(mine <= len(o.rows) + len(o.joining) or len(o.rows) + len(o.joining) >= self._capacity(o)
                       for o in self._lanes if o is not lane):
                    taken, self._waiting = self._waiting[:room], self._waiting[room:]
                    lane.joining = taken
                    return taken
            if lane.rows:
                return []
            self._cond.wait()
        return []

    @staticmethod
    def _drop_cancelled(seq: _Seq) -> bool:
        if seq.stream.cancelled:
            seq.stream.finished = True
            return True
        return False


class _Lane:
    """One batch on its own thread."""

    def __init__(self, engine: Engine, index: int) -> None:
        self.engine = engine
        self.index = index
        self.rows: list[_Seq] = []
        self.joining: list[_Seq] = []
        self.cache = None  # the batch's cache, row i is self.rows[i]
        self.mask: torch.Tensor | None = None  # [B, L] 1 for real positions, 0 for left padding
        self.attempt = DecodeAttempt(engine.dispatcher)
        self.replay_pending = False  # every row is to be recomputed from its prompt
        self.healthy = True
        self.failures: collections.deque[float] = collections.deque()  # monotonic times, last minute
        self.thread = threading.Thread(target=self._supervise, name=f"lane-{index}", daemon=True)

    # -- the loop --------------------------------------------------------------------

    def _supervise(self) -> None:
        """The lane's thread: runs the loop, and restarts it if it ever fails (a bug, or an
        error outside any step), after ending the lane's requests with an error: a lane never
        dies silently, and its requests never wait forever."""
        threads_initializer()()
        while True:
            try:
                self._loop()
                break  # the engine closed
            except Exception as exc:
                log.exception("an engine lane failed; ending its requests and restarting it", lane=self.index)
                self._fail_all(f"the decode failed: {type(exc).__name__}: {exc}", "internal")
                if not self.engine._lane_failed(self):
                    break
        self._fail_all("the backbone is shutting down", "unavailable")

    def _loop(self) -> None:
        engine = self.engine
        with self.attempt.active():
            while True:
                with engine._cond:
                    self._drop_cancelled()
                    engine._take(self)
                    if engine._closed:
                        return
                try:
                    with torch.inference_mode():
                        self._advance()
                except Exception as exc:  # a failure of one step ends its requests, not the lane
                    log.exception("a decode step failed; ending its requests", lane=self.index)
                    self._fail_all(f"the decode failed: {type(exc).__name__}: {exc}", "internal")
                if not self.rows and not self.joining:
                    self.attempt.restart()  # the next requests start a decode of their own
                engine._lane_ok(self)

    def _advance(self) -> None:
        """Admit the joining requests and step the batch once. A pass tainted by a worker
        caught in it is recomputed in ``_pass``; when a session used before it can no longer
        be trusted, every row is recomputed from its prompt (``_replay``)."""
        while True:
            try:
                if self.replay_pending:
                    self._replay()
                    self.replay_pending = False
                while self.joining:
                    n = self._prefill_count()
                    self._join_many([s for s in self.joining[:n] if not s.stream.cancelled])
                    self.joining = self.joining[n:]
                self._drop_cancelled()
                if self.rows:
                    self._step()
                return
            except ReplayNeeded as exc:
                self.attempt.replaying(exc, from_pass=0)
                log.warning("recomputing the lane's requests from their prompts without an untrusted worker",
                            lane=self.index, reason=str(exc), rows=len(self.rows) + len(self.joining),
                            rewinds=self.attempt.rewinds)
                self.replay_pending = True

    def _pass(self, forward: Callable[[], T], cut_back: Callable[[], None] | None) -> T:
        """One forward pass and its settle, ``forward()``; recomputed while what taints it
        is a worker caught in this very pass, after ``cut_back()`` restored the cache (None:
        it cannot be; then, as for a taint from an earlier pass, ReplayNeeded propagates)."""
        while True:
            try:
                return forward()
            except ReplayNeeded as exc:
                if cut_back is None or exc.from_pass < self.attempt.passes:
                    raise
                self.attempt.replaying(exc)
                log.info("recomputing a pass without a worker caught in it", lane=self.index, reason=str(exc),
                         retries=self.attempt.retries, all_local=self.attempt.local_pass)
                cut_back()

    def _fail_all(self, message: str, kind: str) -> None:
        try:
            for seq in self.rows + self.joining:
                if not seq.stream.finished:
                    seq.stream._put(StreamEvent(error=message, error_kind=kind))
        finally:
            self.rows, self.joining, self.cache, self.mask = [], [], None, None
            self.replay_pending = False
            self.attempt.restart()
            self.engine._wake()

    def _drop_cancelled(self) -> None:
        keep = [i for i, seq in enumerate(self.rows) if not seq.stream.cancelled and not seq.stream.finished]
        if len(keep) != len(self.rows):
            for seq in self.rows:
                if seq.stream.cancelled:
                    seq.stream.finished = True
            self._select(keep)
            self.engine._wake()

    # -- prefill, step, sampling -----------------------------------------------------

    def _prefill_count(self) -> int:
        """How many of the joining requests to prefill in one forward pass: one where the
        model's cache cannot take left padding, else as many as fit PREFILL_TOKENS padded."""
        if not self.engine.pad_prefill:
            return 1
        longest = 0
        for n, seq in enumerate(self.joining):
            longest = max(longest, len(seq.req.prompt_ids))
            if n and longest * (n + 1) > PREFILL_TOKENS:
                return n
        return len(self.joining)

    def _prefill(self, seqs: list[_Seq]):  # type: ignore[no-untyped-def]
        """The prompts of ``seqs`` through the model in one pass, left-padded to the longest
        (the padding keeps out of the experts path): ``(cache, mask [B, L], last logits [B, V])``."""
        from kvasir_rpc import growing_cache

        length = max(len(seq.req.prompt_ids) for seq in seqs)
        ids = torch.full((len(seqs), length), self.engine.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, seq in enumerate(seqs):
            n = len(seq.req.prompt_ids)
            ids[i, length - n:] = torch.tensor(seq.req.prompt_ids, dtype=torch.long)
            mask[i, length - n:] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        owners = torch.arange(len(seqs))[:, None].expand(-1, length).masked_fill(mask == 0, -1).reshape(-1)

        def forward():  # type: ignore[no-untyped-def]
            cache = growing_cache(self.engine.model.config)
            with self.engine.dispatcher.tally_rows(owners, len(seqs)) as tally:
                out = self.engine.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                                        use_cache=True, logits_to_keep=1)
                self.attempt.settle()  # no token from these logits before their audits passed
            return cache, out, tally

        cache, out, tally = self._pass(forward, cut_back=lambda: None)  # a new cache each time
        self._add_rows(tally, seqs)
        return cache, mask, out.logits[:, -1].float()

    def _join_many(self, seqs: list[_Seq]) -> None:
        """Prefill ``seqs`` together, send each its first token, and append the ones that go
        on to the batch."""
        if not seqs:
            return
        now = time.perf_counter()
        for seq in seqs:
            seq.admitted = seq.admitted or now
        cache, mask, logits = self._prefill(seqs)
        tokens = self._choose(logits, seqs)
        going = [i for i, (seq, token) in enumerate(zip(seqs, tokens)) if not self._emit(seq, token)]
        if not going:
            return
        if len(going) < len(seqs):
            index = torch.tensor(going, dtype=torch.long)
            mask = mask[index]
            pad = _common_padding(mask)
            _select_cache(cache, index, pad)
            mask = mask[:, pad:]
        self._append_rows([seqs[i] for i in going], cache, mask, [tokens[i] for i in going])

    def _append_rows(self, seqs: list[_Seq], cache, mask: torch.Tensor, tokens: list[int]) -> None:  # type: ignore[no-untyped-def]
        """Prefilled ``seqs`` (their cache and its mask, their next inputs) join the batch."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
        else:
            assert self.mask is not None
            self.cache, self.mask = _concat(self.cache, self.mask, cache, mask)
        for seq, token in zip(seqs, tokens):
            seq.next_token = token
        self.rows.extend(seqs)
        for s in self.rows:
            s.max_batch = max(s.max_batch, len(self.rows))

    def _step(self) -> None:
        """One token for every row."""
        assert self.mask is not None
        rows = self.rows
        ids = torch.tensor([[s.next_token] for s in rows], dtype=torch.long)
        mask = torch.cat([self.mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
        positions = (mask.sum(dim=1, keepdim=True) - 1)
        cache = self.cache

        def forward():  # type: ignore[no-untyped-def]
            with self.engine.dispatcher.tally_rows(torch.arange(len(rows)), len(rows)) as tally:
                out = self.engine.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                        cache=cache, use_cache=True)
                self.attempt.settle()
            return out, tally

        out, tally = self._pass(forward, _cut_back(cache))
        self.mask = mask  # the cache grew in place (its layers: kvasir_rpc/_kv_cache.py)
        self.engine._stepped(len(rows))
        self._add_rows(tally, rows)
        tokens = self._choose(out.logits[:, -1].float(), rows)
        done = [self._emit(s, t) for s, t in zip(rows, tokens)]
        for s, t in zip(rows, tokens):
            s.next_token = t
        if any(done):
            self._select([i for i, d in enumerate(done) if not d])
            self.engine._wake()

    @staticmethod
    def _add_rows(tally: torch.Tensor, rows: list[_Seq]) -> None:
        counts = tally.tolist()
        for i, seq in enumerate(rows):
            for kind in range(3):
                seq.rows[kind] += int(counts[kind][i])

    @staticmethod
    def _choose(logits: torch.Tensor, rows: list[_Seq]) -> list[int]:
        """The next token of each row from its logits [B, V]: argmax for greedy rows, a
        draw from the row's own generator otherwise."""
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, seq in enumerate(rows):
            if seq.digest is not None:
                seq.digest.update(logits[i].to(torch.float32).numpy().astype("<f4").tobytes())
            s = seq.req.sampling
            if s.greedy:
                out.append(int(greedy[i]))
                continue
            out.append(_sample(logits[i], s, seq.generator))
        return out

    # -- text, stops, the end ----------------------------------------------------------

    def _emit(self, seq: _Seq, token: int) -> bool:
        """Record ``token`` for ``seq`` and send what is now certain; True when it finished."""
        now = time.perf_counter()
        if not seq.generated:
            seq.first = now
        seq.generated.append(token)
        req = seq.req
        finish: Finish | None = None
        matched = ""
        text = self.engine.tokenizer.decode(seq.generated, skip_special_tokens=True,
                                            clean_up_tokenization_spaces=False)
        end = len(text)
        if token in seq.eos:
            finish = Finish.EOS
        if req.stop:
            start = max(0, seq.sent_chars - MAX_STOP_CHARS)
            hits = [(i, s) for s in req.stop if (i := text.find(s, start)) >= 0]
            if hits:
                end, matched = min(hits)
                finish = Finish.STOP
        if finish is None and len(seq.generated) >= req.max_tokens:
            finish = Finish.LENGTH
        if finish is None:
            end = _certain_end(text, req.stop)
        end = max(end, seq.sent_chars)
        chunk_ids = tuple(seq.generated[len(seq.delivered):])
        chunk_text = text[seq.sent_chars:end]
        seq.delivered.extend(chunk_ids)
        seq.sent_chars = end
        if finish is None:
            seq.stream._put(StreamEvent(token_ids=chunk_ids, text=chunk_text))
            return False
        n = len(seq.generated)
        decode_s = now - seq.first
        summary = Summary(
            finish=finish, stop=matched, prompt_tokens=len(req.prompt_ids), completion_tokens=n,
            queue_seconds=seq.admitted - seq.arrived, time_to_first_token_seconds=seq.first - seq.arrived,
            total_seconds=now - seq.arrived, tokens_per_second=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            remote_rows=seq.rows[0], local_rows=seq.rows[1], fallback_rows=seq.rows[2],
            max_batch_size=seq.max_batch, seed=seq.seed,
            logits_digest=seq.digest.digest() if seq.digest is not None else b"")
        self.engine._finished(n)
        seq.stream._put(StreamEvent(token_ids=chunk_ids, text=chunk_text, summary=summary))
        return True

    # -- replays ---------------------------------------------------------------------

    def _replay(self) -> None:
        """Recompute every row from its prompt (the untrusted worker is no longer used)
        and rebuild the batch; a row whose sent tokens come out different ends with an
        error. A new ReplayNeeded from an earlier pass propagates: ``_advance`` replays
        again, from the tokens sent."""
        pending = [s for s in self.rows + self.joining if not s.stream.finished and not s.stream.cancelled]
        self.rows, self.joining, self.cache, self.mask = [], pending, None, None
        with torch.inference_mode():
            for seq in pending:
                sent = seq.restart()
                if not sent:
                    self._join_many([seq])
                else:
                    self._verify(seq, sent)
                self.joining = self.joining[1:]

    def _verify(self, seq: _Seq, sent: list[int]) -> None:
        """Decode ``seq`` alone again up to the tokens it sent; back into the batch if they
        come out the same, else ended with an error."""
        cache, mask, logits = self._prefill([seq])
        for k, expected in enumerate(sent):
            token = self._choose(logits, [seq])[0]
            if token != expected:
                seq.stream._put(StreamEvent(error=(
                    f"a worker caught delivering wrong work had changed token {k} of this decode, so the "
                    "tokens sent from there on were wrong; retry the request"), error_kind="aborted"))
                return
            seq.generated.append(token)
            if k + 1 < len(sent):
                mask, logits = self._forward_one(seq, cache, mask, token)
        self._append_rows([seq], cache, mask, [sent[-1]])

    def _forward_one(self, seq: _Seq, cache, mask: torch.Tensor, token: int):  # type: ignore[no-untyped-def]
        """One more token of ``seq`` alone: its grown mask and next logits [1, V]."""
        mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)

        def forward():  # type: ignore[no-untyped-def]
            with self.engine.dispatcher.tally_rows(torch.zeros(1, dtype=torch.long), 1) as tally:
                out = self.engine.model(input_ids=torch.tensor([[token]], dtype=torch.long), attention_mask=mask,
                                        position_ids=torch.tensor([[mask.shape[1] - 1]]), cache=cache,
                                        use_cache=True)
                self.attempt.settle()
            return out, tally

        out, tally = self._pass(forward, _cut_back(cache))
        self._add_rows(tally, [seq])
        return mask, out.logits[:, -1].float()

    # -- the batch's cache -------------------------------------------------------------

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in order), trimming padding no row needs any more."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.mask = None, None
            return
        assert self.mask is not None
        index = torch.tensor(keep, dtype=torch.long)
        mask = self.mask[index]
        pad = _common_padding(mask)
        _select_cache(self.cache, index, pad)
        self.mask = mask[:, pad:]


def _cut_back(cache) -> Callable[[], None] | None:  # type: ignore[no-untyped-def]
    """A function that cuts ``cache`` back to the length each layer has now, or None when
    its layers are not all attention keys/values (linear-attention states change in place)."""
    if any(not _kv(layer) or hasattr(layer, "conv_states") for layer in cache.layers):
        return None
    lengths = [layer.keys.shape[-2] for layer in cache.layers]
    return lambda: cut_cache(cache, lengths)


def cut_cache(cache, length: int | list[int]) -> None:  # type: ignore[no-untyped-def]
    """Cut every attention layer of ``cache`` back to ``length`` positions (one for all, or
    one per layer) where it holds more. A pass stopped part way has grown the layers before
    the one it stopped in, not the others, so each layer is cut on its own."""
    lengths = length if isinstance(length, list) else [length] * len(cache.layers)
    for layer, n in zip(cache.layers, lengths):
        if _kv(layer) and layer.keys.shape[-2] > n:
            layer.keys = layer.keys[..., :n, :]
            layer.values = layer.values[..., :n, :]


def _common_padding(mask: torch.Tensor) -> int:
    """Leading columns that are padding in every row of ``mask`` [B, L]."""
    return int((mask.cumsum(dim=1) == 0).sum(dim=1).min().item())


def _sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> int:
    x = logits / s.temperature
    if s.top_k and s.top_k < x.numel():
        kth = torch.topk(x, s.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if 0.0 < s.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the ones before it already reach top_p (the first always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= s.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _certain_end(text: str, stops: tuple[str, ...]) -> int:
    """How much of ``text`` can be sent now: not a trailing replacement character (half a
    character, the rest in the next token) nor a tail that may begin a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, end), 0, -1):
            if text.endswith(stop[:n], 0, end):
                hold = max(hold, n)
                break
    return end - hold


# -- cache layout: transformers' DynamicCache, attention and linear-attention layers -------

def _cache_layout(model) -> tuple[bool, bool, str]:  # type: ignore[no-untyped-def]
    """``(batchable, kv_only, why not batchable)`` of the model's DynamicCache: whether its
    layers can be left-padded and batched (attention keys/values, linear-attention states),
    and whether they are attention keys/values only (so prompts can be prefilled padded)."""
    from transformers import DynamicCache

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception as exc:  # a model whose cache this code does not know
        return False, False, f"cannot build its cache: {exc}"
    for layer in layers:
        if getattr(layer, "is_sliding", False):
            return False, False, "sliding-window attention layers"
        if not (hasattr(layer, "keys") or hasattr(layer, "conv_states")):
            return False, False, f"cache layer {type(layer).__name__}"
    return True, not any(hasattr(layer, "conv_states") for layer in layers), ""


def _kv(layer) -> bool:  # type: ignore[no-untyped-def]
    keys = getattr(layer, "keys", None)
    return isinstance(keys, torch.Tensor) and keys.dim() == 4 and bool(getattr(layer, "is_initialized", True))


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[-2] = n
    return torch.cat([t.new_zeros(shape), t], dim=-2)


def _concat(a, a_mask: torch.Tensor, b, b_mask: torch.Tensor):  # type: ignore[no-untyped-def]
    """Batch cache ``a`` with the rows of ``b`` appended; both left-padded to one length."""
    la, lb = a_mask.shape[1], b_mask.shape[1]
    length = max(la, lb)
    for la_layer, lb_layer in zip(a.layers, b.layers):
        if _kv(la_layer) and _kv(lb_layer):
            la_layer.keys = torch.cat([_pad_left(la_layer.keys, length - la), _pad_left(lb_layer.keys, length - lb)])
            la_layer.values = torch.cat([_pad_left(la_layer.values, length - la),
                                         _pad_left(lb_layer.values, length - lb)])
        for name in ("conv_states", "recurrent_states"):
            states_a, states_b = getattr(la_layer, name, None), getattr(lb_layer, name, None)
            if isinstance(states_a, dict) and isinstance(states_b, dict):
                for k, v in states_a.items():
                    if isinstance(v, torch.Tensor) and isinstance(states_b.get(k), torch.Tensor):
                        states_a[k] = torch.cat([v, states_b[k]])
    mask = torch.cat([torch.nn.functional.pad(a_mask, (length - la, 0)),
                      torch.nn.functional.pad(b_mask, (length - lb, 0))])
    return a, mask


def _select_cache(cache, index: torch.Tensor, pad: int) -> None:  # type: ignore[no-untyped-def]
    for layer in cache.layers:
        if _kv(layer):
            layer.keys = layer.keys[index, :, pad:]
            layer.values = layer.values[index, :, pad:]
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                for k, v in states.items():
                    if isinstance(v, torch.Tensor):
                        states[k] = v[index]
