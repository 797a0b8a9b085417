// The protocol logic of one worker session, free of Node APIs: the phases of the WebSocket
// (PROTOCOL.md 2, 3), the handshake (4), the end-to-end channel (4.5), tunnel control (5) with
// each "open" spliced into a local HTTP/2 server, keepalive and sealed heartbeats (6) and close
// codes (7). The Node worker (session.ts: ws, node:crypto, node:http2) and the web page
// (clients/web/src/session.ts: the browser's WebSocket, WebCrypto) are adapters over it.
// A cipher or a handshake may answer at once (node:crypto) or with a promise (WebCrypto):
// received messages are handled one after another (a promise chain), and what is sent goes out
// in the order it was sealed.

import type { GrpcServer, GrpcServerConnection } from "../h2/grpc.js";
import { CloseCode, closeClass, LocalProtocolError, ProtocolError } from "./bytes_core.js";
import { HeartbeatMonitor, type Opened } from "./channel_core.js";
import { MAX_DATA_BYTES, WorkerTunnel } from "./tunnel.js";

export const TUNNEL_SUBPROTOCOL = "kvasir.tunnel.v1";
/** Every tunnel version this worker speaks, newest first. */
export const TUNNEL_SUBPROTOCOLS = [TUNNEL_SUBPROTOCOL];
export const KEEPALIVE_MS = 15_000;
export const KEEPALIVE_TIMEOUT_MS = 10_000;
export const HANDSHAKE_TIMEOUT_MS = 15_000;
/** Send backpressure: with more than this many bytes queued on the WebSocket (its
 * bufferedAmount), no received tunnel data goes to the local server (no new calls start). */
export const SEND_HIGH_WATER_BYTES = 8 << 20;
/** ... until the queue is down to this many bytes. */
export const SEND_LOW_WATER_BYTES = 2 << 20;
/** How often the queue is looked at while over the high-water mark (a browser fires no drain event). */
export const SEND_DRAIN_POLL_MS = 50;
/** Not drained under the low-water mark this long after passing the high one: the session is closed (1001). */
export const SEND_STALL_TIMEOUT_MS = 30_000;

type Maybe<T> = T | Promise<T>;
type Message = Uint8Array | string;

/** The end-to-end cipher of a session: node:crypto's answers at once, WebCrypto's with promises. */
export interface SessionCipher {
  sealData(data: Uint8Array): Maybe<Uint8Array>;
  sealControl(word: string): Maybe<Uint8Array>;
  sealHeartbeat(seq: bigint, ack: boolean): Maybe<Uint8Array>;
  open(message: Message): Maybe<Opened>;
}

export interface SessionAccepted {
  sessionId: string;
  aead: number;
  cipher: SessionCipher | undefined;
  hubKey: string;
}

/** The worker's side of the handshake (4). */
export interface SessionHandshake {
  receiveChallenge(data: Uint8Array): Maybe<Uint8Array>;
  receiveAccept(data: Uint8Array): Maybe<SessionAccepted>;
}

/** The WebSocket, as the core uses it; its events come in through SessionCore's methods. */
export interface SessionTransport {
  /** Send one message; `sent` (when given) is called once it has gone out. */
  send(msg: Message, sent?: () => void): void;
  /** A WebSocket ping; undefined where there is none (a browser): then only a sealed session is checked. */
  ping?: () => void;
  /** Bytes sent but not yet written to the network (WebSocket.bufferedAmount): above
   * SEND_HIGH_WATER_BYTES the core holds received tunnel data; undefined: no bound. */
  bufferedAmount?: () => number;
  /** Close with `code`; `reason` may be longer than a close frame takes (closeReason). */
  close(code: number, reason: string): void;
  /** The close did not complete within 5 s. */
  abort(): void;
}

/** The local end of one tunnel connection, whichever HTTP/2 server serves it. */
export interface LocalConnection {
  /** Still the tunnel's current connection (no "close" yet). */
  active: boolean;
  eofSent: boolean;
  readonly destroyed: boolean;
  /** Bytes that came through the tunnel. */
  deliver(data: Uint8Array): void;
  destroy(): void;
}

/** A timer clock (setTimeout and clearTimeout by default). */
export interface Clock {
  set(fn: () => void, ms: number): unknown;
  clear(t: unknown): void;
}

const globalClock: Clock = {
  set: (fn, ms) => setTimeout(fn, ms),
  clear: (t) => clearTimeout(t as ReturnType<typeof setTimeout>),
};

export interface SessionEnd {
  /** The accept arrived: the session was live. */
  established: boolean;
  /** The close code (received, or sent by this side); undefined when the WebSocket never opened. */
  code: number | undefined;
  reason: string;
  /** This side closed (a refusal of its own, or stop()). */
  local: boolean;
  /** Dialling again unchanged gets the same answer (a permanent close code, closeClass; an HTTP 4xx other than 429). */
  fatal: boolean;
  /** The server asked to wait (HTTP Retry-After). */
  retryAfterMs?: number;
}

export interface SessionCoreOptions {
  log: (line: string) => void;
  /** A new local connection for a tunnel "open"; its writes go to `core.localData`, its end to `core.localEof`. */
  connect: (core: SessionCore) => LocalConnection;
  /** Called when the session is live (the accept checked). */
  onLive?: (sessionId: string, encrypted: boolean) => void;
  keepaliveMs?: number;
  clock?: Clock;
}

/** Truncate a close reason to 120 bytes of UTF-8 (PROTOCOL.md 7; RFC 6455 allows 123). */
export function closeReason(reason: string): string {
  let r = reason;
  const enc = new TextEncoder();
  while (enc.encode(r).byteLength > 120) r = r.slice(0, -1);
  return r;
}

/** One tunnel connection served by the sans-IO HTTP/2 + gRPC server (src/h2): bytes in, bytes out. */
export class SansIoConnection implements LocalConnection {
  active = true;
  eofSent = false;
  destroyed = false;
  private readonly grpc: GrpcServerConnection;

  constructor(core: SessionCore, server: GrpcServer) {
    this.grpc = server.connect({
      write: (bytes) => core.localData(this, bytes),
      close: () => core.localEof(this),
    });
  }

  deliver(data: Uint8Array): void {
    this.grpc.receive(data.slice()); // the connection keeps views of what it is given
  }

  destroy(): void {
    if (this.destroyed) return;
    this.destroyed = true;
    this.grpc.close();
  }
}

function textInHandshake(): ProtocolError {
  return new ProtocolError(CloseCode.PROTOCOL_ERROR, "a text message during the handshake");
}

type Phase = "connecting" | "challenge" | "accept" | "live" | "over";

export class SessionCore {
  private transport: SessionTransport | undefined;
  private hs: SessionHandshake | undefined;
  private phase: Phase = "connecting";
  private cipher: SessionCipher | undefined;
  private readonly tunnel = new WorkerTunnel();
  private conn: LocalConnection | undefined;
  private readonly monitor = new HeartbeatMonitor();
  private readonly clock: Clock;
  private received: Promise<void> = Promise.resolve();
  private sending: Promise<void> = Promise.resolve();
  /** Sends waiting in `sending`: while any is, a ready message waits its turn too. */
  private queued = 0;
  private timers = new Set<unknown>();
  private keepalive: unknown;
  private answerTimer: unknown;
  /** Why the answer timer, when it fires, ends the session (a heartbeat's or a ping's). */
  private answerWhy = "";
  /** A heartbeat or ping is unanswered, its timer suspended while sending is backpressured. */
  private answerSuspended = false;
  /** Over the high-water mark: received tunnel data is held, not delivered (send backpressure). */
  private paused = false;
  private pausedAt = 0;
  private pollTimer: unknown;
  private stallTimer: unknown;
  /** Tunnel data held while paused, delivered in order once the queue drains. */
  private held: Uint8Array[] = [];
  private heldCount = 0;
  private established = false;
  private ended: SessionEnd | undefined;
  private resolve!: (end: SessionEnd) => void;
  readonly done: Promise<SessionEnd>;
  sessionId = "";

  constructor(private readonly opts: SessionCoreOptions) {
    this.clock = opts.clock ?? globalClock;
    this.done = new Promise((r) => (this.resolve = r));
  }

  get live(): boolean {
    return this.phase === "live";
  }

  /** The WebSocket has not opened yet. */
  get connecting(): boolean {
    return this.phase === "connecting";
  }

  get isEstablished(): boolean {
    return this.established;
  }

  get encrypted(): boolean {
    return this.cipher !== undefined;
  }

  /** Received tunnel data is being held: the WebSocket's send queue is over the high-water mark. */
  get backpressured(): boolean {
    return this.paused;
  }

  /** Bytes of received tunnel data held now (send backpressure). */
  get heldBytes(): number {
    return this.heldCount;
  }

  timer(ms: number, fn: () => void): unknown {
    const t = this.clock.set(() => {
      this.timers.delete(t);
      fn();
    }, ms);
    this.timers.add(t);
    return t;
  }

  clearTimer(t: unknown): void {
    if (t === undefined) return;
    this.clock.clear(t);
    this.timers.delete(t);
  }

  /** The WebSocket is dialled: the handshake must complete within HANDSHAKE_TIMEOUT_MS. */
  attach(transport: SessionTransport, hs: SessionHandshake): void {
    this.transport = transport;
    this.hs = hs;
    this.timer(HANDSHAKE_TIMEOUT_MS, () => {
      if (!this.established) this.fail(new ProtocolError(CloseCode.HANDSHAKE_TIMEOUT, "handshake timed out"));
    });
  }

  /** The WebSocket opened with `protocol` (3). */
  opened(protocol: string): void {
    if (!TUNNEL_SUBPROTOCOLS.includes(protocol)) {
      const why = `the server chose subprotocol ${JSON.stringify(protocol)}, not one offered`;
      this.fail(new ProtocolError(CloseCode.PROTOCOL_ERROR, why));
      return;
    }
    this.phase = "challenge";
  }

  /** A message arrived: handled after those before it. */
  receive(msg: Message): void {
    this.received = this.received.then(() => this.onMessage(msg)).catch((exc: unknown) => this.fail(exc));
  }

  /** A WebSocket pong arrived. */
  pong(): void {
    if (!this.cipher) this.answered();
  }

  /** The hub answered the heartbeat or ping waiting: its timer is done. */
  private answered(): void {
    this.clearTimer(this.answerTimer);
    this.answerTimer = undefined;
    this.answerSuspended = false;
  }

  private armAnswerTimer(why: string): void {
    this.answerWhy = why;
    this.answerTimer = this.timer(KEEPALIVE_TIMEOUT_MS, () =>
      this.fail(new ProtocolError(CloseCode.GOING_AWAY, this.answerWhy)),
    );
  }

  private async onMessage(msg: Message): Promise<void> {
    switch (this.phase) {
      case "challenge": {
        if (typeof msg === "string") throw textInHandshake();
        this.phase = "accept";
        this.send(await this.hs!.receiveChallenge(msg));
        return;
      }
      case "accept": {
        if (typeof msg === "string") throw textInHandshake();
        const acc = await this.hs!.receiveAccept(msg);
        if (this.phase !== "accept") return;
        this.cipher = acc.cipher;
        this.sessionId = acc.sessionId;
        this.phase = "live";
        this.established = true;
        const aead = acc.aead === 1 ? "AES-256-GCM" : "ChaCha20-Poly1305";
        this.opts.log(
          `session ${acc.sessionId} live with hub ${acc.hubKey.slice(0, 16)}…` +
            (acc.cipher ? `, encrypted end to end (${aead})` : ", not encrypted"),
        );
        this.opts.onLive?.(acc.sessionId, acc.cipher !== undefined);
        this.startKeepalive();
        return;
      }
      case "live": {
        if (this.cipher) {
          const opened = await this.cipher.open(msg);
          switch (opened.kind) {
            case "heartbeat":
              this.send(this.cipher.sealHeartbeat(opened.seq, true)); // at once (4.5)
              return;
            case "ack":
              this.monitor.receiveAck(opened.seq);
              this.answered();
              return;
            case "data":
              this.onTunnel(opened.data);
              return;
            case "control":
              this.onTunnel(opened.word);
              return;
          }
        }
        this.onTunnel(msg);
        return;
      }
      default:
        return; // connecting (cannot happen) or over: ignore
    }
  }

  /** Send what `what` gives, after everything sent before it; `sent` once it has gone out. */
  private send(what: Maybe<Message>, sent?: () => void): void {
    const transport = this.transport!;
    if (!(what instanceof Promise) && this.queued === 0) {
      transport.send(what, sent);
      return;
    }
    this.queued += 1;
    this.sending = this.sending
      .then(async () => {
        const m = await what;
        transport.send(m, sent);
      })
      .catch((exc: unknown) => this.fail(exc))
      .finally(() => (this.queued -= 1));
  }

  private onTunnel(msg: Message): void {
    const ev = this.tunnel.receive(msg);
    switch (ev.kind) {
      case "open":
        this.conn = this.opts.connect(this);
        return;
      case "data":
        if (!ev.drop && this.conn && !this.conn.destroyed) this.deliver(ev.data);
        return;
      case "close":
        this.dropConnection();
        this.sendControl(this.tunnel.closed());
        return;
    }
  }

  /** Received tunnel data to the local server, unless sending is backpressured: then it waits. */
  private deliver(data: Uint8Array): void {
    if (!this.paused && this.held.length === 0 && this.overHighWater()) this.pause();
    if (this.paused || this.held.length > 0) {
      this.held.push(data);
      this.heldCount += data.byteLength;
      return;
    }
    this.conn!.deliver(data);
  }

  private overHighWater(): boolean {
    const buffered = this.transport?.bufferedAmount;
    return buffered !== undefined && buffered() > SEND_HIGH_WATER_BYTES;
  }

  /**
   * The WebSocket's send queue is over the high-water mark (the hub reads slower than the calls
   * answer): hold received tunnel data, so the local server starts no new call and sends the hub
   * no window to send more, until the queue drains below the low-water mark; close 1001 if it
   * has not within SEND_STALL_TIMEOUT_MS. A heartbeat's answer waits behind the queue:
   * its timer is suspended meanwhile, and no heartbeat is sent.
   */
  private pause(): void {
    if (this.paused || this.phase !== "live") return;
    const buffered = this.transport!.bufferedAmount!;
    this.paused = true;
    this.pausedAt = Date.now();
    const mib = (n: number): string => (n / 2 ** 20).toFixed(1);
    this.opts.log(
      `${mib(buffered())} MiB of replies wait to be sent: taking no new calls until under ` +
        `${mib(SEND_LOW_WATER_BYTES)} MiB (closing if still over ${mib(SEND_HIGH_WATER_BYTES)} MiB in ` +
        `${SEND_STALL_TIMEOUT_MS / 1000} s)`,
    );
    if (this.answerTimer !== undefined) {
      this.clearTimer(this.answerTimer);
      this.answerTimer = undefined;
      this.answerSuspended = true;
    }
    this.stallTimer = this.timer(SEND_STALL_TIMEOUT_MS, () => {
      const why =
        `send queue not drained: ${mib(buffered())} MiB unsent ${SEND_STALL_TIMEOUT_MS / 1000} s ` +
        `after passing ${mib(SEND_HIGH_WATER_BYTES)} MiB (the hub reads too slowly)`;
      this.fail(new ProtocolError(CloseCode.GOING_AWAY, why));
    });
    const poll = (): void => {
      this.pollTimer = undefined;
      if (this.phase !== "live") return;
      if (buffered() <= SEND_LOW_WATER_BYTES) this.resume();
      else this.pollTimer = this.timer(SEND_DRAIN_POLL_MS, poll);
    };
    this.pollTimer = this.timer(SEND_DRAIN_POLL_MS, poll);
  }

  private resume(): void {
    this.paused = false;
    this.clearTimer(this.stallTimer);
    this.clearTimer(this.pollTimer);
    this.stallTimer = this.pollTimer = undefined;
    const held = this.heldCount;
    this.opts.log(
      `send queue drained after ${((Date.now() - this.pausedAt) / 1000).toFixed(1)} s: ` +
        `taking calls again (${held} B held meanwhile)`,
    );
    if (this.answerSuspended) {
      this.answerSuspended = false;
      this.armAnswerTimer(this.answerWhy);
    }
    // Held data goes in order; a delivery whose answers fill the queue again pauses the rest.
    while (this.held.length > 0 && !this.paused && this.phase === "live") {
      const data = this.held.shift()!;
      this.heldCount -= data.byteLength;
      if (this.conn && !this.conn.destroyed) this.conn.deliver(data);
      if (this.held.length > 0 && this.overHighWater()) this.pause();
    }
  }

  private sendControl(word: string): void {
    this.send(this.cipher ? this.cipher.sealControl(word) : word);
  }

  /**
   * Bytes the local HTTP/2 server wrote on `conn`; `written` (when given) is called once all of
   * them went out, or at once when they go nowhere.
   */
  localData(conn: LocalConnection, chunk: Uint8Array, written?: () => void): void {
    if (chunk.length === 0 || !conn.active || this.phase !== "live" || !this.tunnel.canSendData() || conn.eofSent) {
      written?.(); // the connection is over: its late bytes go nowhere (5.4)
      return;
    }
    let pending = 0;
    for (let at = 0; at < chunk.length; at += MAX_DATA_BYTES) {
      const piece = chunk.slice(at, Math.min(chunk.length, at + MAX_DATA_BYTES));
      this.tunnel.sendData(piece.length);
      pending += 1;
      this.send(this.cipher ? this.cipher.sealData(piece) : piece, () => {
        pending -= 1;
        if (pending === 0) written?.();
      });
    }
  }

  /** The local HTTP/2 server ended `conn` (end of its writes, or the stream destroyed). */
  localEof(conn: LocalConnection): void {
    if (conn.eofSent) return;
    conn.eofSent = true;
    if (conn.active && this.phase === "live" && this.tunnel.state === "OPEN") this.sendControl(this.tunnel.eof());
  }

  private startKeepalive(): void {
    // Without a WebSocket ping (a browser answers the hub's but cannot send one), only the
    // sealed heartbeat checks the hub, end to end (4.5, 6).
    const ping = this.transport?.ping;
    if (!this.cipher && !ping) return;
    const every = this.opts.keepaliveMs ?? KEEPALIVE_MS;
    const beat = (): void => {
      this.keepalive = this.timer(every, beat);
      if (this.phase !== "live" || this.answerTimer !== undefined || this.answerSuspended) return;
      // Behind a full send queue a heartbeat would wait its turn: the stall timer watches instead.
      if (this.overHighWater()) this.pause();
      if (this.paused) return;
      if (this.cipher) {
        const seq = this.monitor.beat();
        this.send(this.cipher.sealHeartbeat(seq, false));
        this.armAnswerTimer("no sealed heartbeat answer within 10 s: the hub is gone or a relay is answering for it");
      } else if (ping) {
        ping();
        this.armAnswerTimer("no pong within 10 s");
      }
    };
    this.keepalive = this.timer(every, beat);
  }

  /** End the session for `exc` (a ProtocolError names its close code; anything else is our bug: 1011). */
  fail(exc: unknown): void {
    if (exc instanceof ProtocolError) {
      this.opts.log(`closing ${exc.code}: ${exc.message}`);
      this.close(exc.code, exc.message);
    } else {
      const what = exc instanceof LocalProtocolError ? "protocol bug" : "internal error";
      this.opts.log(`closing 1011: ${what}: ${exc instanceof Error ? (exc.stack ?? exc.message) : String(exc)}`);
      this.close(CloseCode.INTERNAL_ERROR, `${what}: ${exc instanceof Error ? exc.message : String(exc)}`);
    }
  }

  /** Close the WebSocket with `code` and `reason`; the session ends when the close completes (or 5 s later). */
  close(code: number, reason: string): void {
    const transport = this.transport;
    if (!transport || this.phase === "over") return;
    this.phase = "over";
    this.dropConnection();
    // A refusal we send with a permanent code (4104, 4103) is as final as one we receive.
    this.ended = { established: this.established, code, reason, local: true, fatal: closeClass(code) === "permanent" };
    transport.close(code, reason);
    this.timer(5000, () => transport.abort());
  }

  private dropConnection(): void {
    const conn = this.conn;
    this.conn = undefined;
    // Data held for the connection goes with it (5.4).
    this.held = [];
    this.heldCount = 0;
    if (conn) {
      conn.active = false;
      conn.destroy();
    }
  }

  /** The WebSocket closed (or never opened): the session is over, as `end` says unless this side closed first. */
  finish(end: SessionEnd): void {
    this.clearTimer(this.keepalive);
    for (const t of this.timers) this.clock.clear(t);
    this.timers.clear();
    this.dropConnection();
    this.phase = "over";
    const result = this.ended ?? end;
    this.ended = result;
    this.resolve(result);
  }
}

/** A session as its caller sees it: an adapter (Node's, the web page's) dials and feeds its core. */
export abstract class SessionHandle {
  readonly done: Promise<SessionEnd>;

  constructor(protected readonly core: SessionCore) {
    this.done = core.done;
  }

  get sessionId(): string {
    return this.core.sessionId;
  }

  get live(): boolean {
    return this.core.live;
  }

  get encrypted(): boolean {
    return this.core.encrypted;
  }

  /** End the session for `exc` (a ProtocolError names its close code; anything else is our bug: 1011). */
  fail(exc: unknown): void {
    this.core.fail(exc);
  }

  /** Close the WebSocket with `code` and `reason`; the session ends when the close completes (or 5 s later). */
  close(code: number, reason: string): void {
    this.core.close(code, reason);
  }
}
