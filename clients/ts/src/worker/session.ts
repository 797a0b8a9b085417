// One session: the WebSocket (PROTOCOL.md 2, 3), the handshake (4), the end-to-end channel
// (4.5), tunnel control (5) with each "open" spliced into the local HTTP/2 server (node:http2,
// or the sans-IO one of src/h2), keepalive (6) and close codes (7).

import { Duplex } from "node:stream";

import WebSocket from "ws";

import type { GrpcServer, GrpcServerConnection } from "../h2/grpc.js";
import { CloseCode, closeClass, LocalProtocolError, ProtocolError } from "./bytes.js";
import { HeartbeatMonitor, type Opened, type TunnelCipher } from "./channel.js";
import { WorkerHandshake, type HandshakeOptions, type HelloInfo } from "./handshake.js";
import type { ExpertServer } from "./service.js";
import { MAX_DATA_BYTES, WorkerTunnel } from "./tunnel.js";

export const TUNNEL_SUBPROTOCOL = "kvasir.tunnel.v1";
/** Every tunnel version this worker speaks, newest first. */
export const TUNNEL_SUBPROTOCOLS = [TUNNEL_SUBPROTOCOL];
/** Either side closes with 1009 on a larger message. */
export const MAX_MESSAGE_BYTES = 4 << 20;
export const KEEPALIVE_MS = 15_000;
export const KEEPALIVE_TIMEOUT_MS = 10_000;
export const HANDSHAKE_TIMEOUT_MS = 15_000;
export const SEND_TIMEOUT_MS = 60_000;

export interface SessionOptions {
  url: string;
  server: ExpertServer;
  hello: HelloInfo;
  handshake: HandshakeOptions;
  /** Extra trust anchors for a wss:// gateway (PEM). */
  ca?: Buffer | undefined;
  log: (line: string) => void;
  keepaliveMs?: number;
  /** The HTTP/2 server of the tunnel's connections: node:http2 (default), or src/h2's sans-IO one. */
  http2?: "node" | "sans-io";
}

export interface SessionEnd {
  /** The accept arrived: the session was live. */
  established: boolean;
  code: number | undefined;
  reason: string;
  /** Dialling again unchanged gets the same answer (a permanent close code, closeClass; an HTTP 4xx other than 429). */
  fatal: boolean;
  /** The server asked to wait (HTTP Retry-After). */
  retryAfterMs?: number;
}

/** Truncate a close reason to 120 bytes of UTF-8 (PROTOCOL.md 7; RFC 6455 allows 123). */
function closeReason(reason: string): string {
  let r = reason;
  while (Buffer.byteLength(r, "utf8") > 120) r = r.slice(0, -1);
  return r;
}

/** The local end of one tunnel connection, whichever HTTP/2 server serves it. */
interface LocalConnection {
  /** Still the tunnel's current connection (no "close" yet). */
  active: boolean;
  eofSent: boolean;
  readonly destroyed: boolean;
  /** Bytes that came through the tunnel. */
  deliver(data: Uint8Array): void;
  destroy(): void;
}

/** The local end of one tunnel connection as a stream: what node:http2's server reads and writes. */
class TunnelConnection extends Duplex implements LocalConnection {
  active = true;
  eofSent = false;

  constructor(private readonly session: Session) {
    super({ allowHalfOpen: true });
  }

  deliver(data: Uint8Array): void {
    this.push(Buffer.from(data));
  }

  override _read(): void {}

  override _write(chunk: Buffer, _enc: BufferEncoding, cb: (err?: Error | null) => void): void {
    this.session.localData(this, chunk, cb);
  }

  override _final(cb: (err?: Error | null) => void): void {
    this.session.localEof(this);
    cb();
  }

  override _destroy(err: Error | null, cb: (err?: Error | null) => void): void {
    this.session.localEof(this);
    cb(err);
  }
}

/** One tunnel connection served by the sans-IO HTTP/2 + gRPC server (src/h2): bytes in, bytes out. */
class SansIoConnection implements LocalConnection {
  active = true;
  eofSent = false;
  destroyed = false;
  private readonly grpc: GrpcServerConnection;

  constructor(session: Session, server: GrpcServer) {
    this.grpc = server.connect({
      write: (bytes) => session.localData(this, bytes, () => undefined),
      close: () => session.localEof(this),
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

type Phase = "connecting" | "challenge" | "accept" | "live" | "over";

export class Session {
  private ws: WebSocket | undefined;
  private phase: Phase = "connecting";
  private hs: WorkerHandshake;
  private cipher: TunnelCipher | undefined;
  private readonly tunnel = new WorkerTunnel();
  private conn: LocalConnection | undefined;
  private readonly monitor = new HeartbeatMonitor();
  private timers = new Set<NodeJS.Timeout>();
  private keepalive: NodeJS.Timeout | undefined;
  private answerTimer: NodeJS.Timeout | undefined;
  private established = false;
  private ended: SessionEnd | undefined;
  private resolve!: (end: SessionEnd) => void;
  readonly done: Promise<SessionEnd>;
  sessionId = "";

  constructor(private readonly opts: SessionOptions) {
    this.hs = new WorkerHandshake(opts.hello, opts.handshake);
    this.done = new Promise((r) => (this.resolve = r));
  }

  get live(): boolean {
    return this.phase === "live";
  }

  get encrypted(): boolean {
    return this.cipher !== undefined;
  }

  private timer(ms: number, fn: () => void): NodeJS.Timeout {
    const t = setTimeout(() => {
      this.timers.delete(t);
      fn();
    }, ms);
    this.timers.add(t);
    return t;
  }

  private clearTimer(t: NodeJS.Timeout | undefined): void {
    if (t === undefined) return;
    clearTimeout(t);
    this.timers.delete(t);
  }

  /** Dial and run until the WebSocket closes; resolves with how it ended. */
  run(): Promise<SessionEnd> {
    const ws = new WebSocket(this.opts.url, TUNNEL_SUBPROTOCOLS, {
      perMessageDeflate: false,
      maxPayload: MAX_MESSAGE_BYTES,
      handshakeTimeout: HANDSHAKE_TIMEOUT_MS,
      ...(this.opts.ca ? { ca: this.opts.ca } : {}),
    });
    this.ws = ws;
    ws.binaryType = "nodebuffer";
    const handshakeTimer = this.timer(HANDSHAKE_TIMEOUT_MS, () => {
      if (!this.established) this.fail(new ProtocolError(CloseCode.HANDSHAKE_TIMEOUT, "handshake timed out"));
    });
    ws.on("unexpected-response", (req, res) => {
      const status = res.statusCode ?? 0;
      const after = Number(res.headers["retry-after"]);
      let body = "";
      res.setEncoding("utf8");
      res.on("data", (c: string) => (body += c.slice(0, 200)));
      const finish = (): void => {
        req.destroy();
        this.finish({
          established: false,
          code: status === 503 ? CloseCode.TRY_AGAIN_LATER : undefined,
          reason: `HTTP ${status} ${res.statusMessage ?? ""}${body ? `: ${body.trim().slice(0, 200)}` : ""}`,
          fatal: status >= 400 && status < 500 && status !== 429,
          ...(Number.isFinite(after) && after > 0 ? { retryAfterMs: after * 1000 } : {}),
        });
      };
      res.on("end", finish);
      res.on("error", finish);
      setTimeout(finish, 2000).unref();
    });
    ws.on("open", () => {
      // ws itself refuses an answer without one of the offered subprotocols; check anyway (3).
      if (!TUNNEL_SUBPROTOCOLS.includes(ws.protocol)) {
        this.fail(new ProtocolError(CloseCode.PROTOCOL_ERROR, `the server chose subprotocol ${JSON.stringify(ws.protocol)}, not one offered`));
        return;
      }
      this.phase = "challenge";
    });
    ws.on("message", (data: Buffer, isBinary: boolean) => {
      try {
        this.onMessage(isBinary ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength) : data.toString("utf8"));
      } catch (exc) {
        this.fail(exc);
      }
    });
    ws.on("pong", () => {
      if (!this.cipher) {
        this.clearTimer(this.answerTimer);
        this.answerTimer = undefined;
      }
    });
    ws.on("error", (err) => {
      if (this.phase === "connecting") this.finish({ established: false, code: undefined, reason: err.message, fatal: false });
    });
    ws.on("close", (code: number, reason: Buffer) => {
      this.clearTimer(handshakeTimer);
      this.finish({ established: this.established, code, reason: reason.toString("utf8"), fatal: closeClass(code) === "permanent" });
    });
    return this.done;
  }

  private onMessage(msg: Uint8Array | string): void {
    switch (this.phase) {
      case "challenge": {
        if (typeof msg === "string") throw new ProtocolError(CloseCode.PROTOCOL_ERROR, "a text message during the handshake");
        const hello = this.hs.receiveChallenge(msg);
        this.phase = "accept";
        this.ws!.send(hello, { binary: true });
        return;
      }
      case "accept": {
        if (typeof msg === "string") throw new ProtocolError(CloseCode.PROTOCOL_ERROR, "a text message during the handshake");
        const acc = this.hs.receiveAccept(msg);
        this.cipher = acc.cipher;
        this.sessionId = acc.sessionId;
        this.phase = "live";
        this.established = true;
        this.opts.log(
          `session ${acc.sessionId} live with hub ${acc.hubKey.slice(0, 16)}…` +
            (acc.cipher ? `, encrypted end to end (${acc.aead === 1 ? "AES-256-GCM" : "ChaCha20-Poly1305"})` : ", not encrypted"),
        );
        this.startKeepalive();
        return;
      }
      case "live": {
        if (this.cipher) {
          const opened: Opened = this.cipher.open(msg);
          switch (opened.kind) {
            case "heartbeat":
              this.ws!.send(this.cipher.sealHeartbeat(opened.seq, true), { binary: true }); // at once (4.5)
              return;
            case "ack":
              this.monitor.receiveAck(opened.seq);
              this.clearTimer(this.answerTimer);
              this.answerTimer = undefined;
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

  private onTunnel(msg: Uint8Array | string): void {
    const ev = this.tunnel.receive(msg);
    switch (ev.kind) {
      case "open": {
        if (this.opts.http2 === "sans-io") {
          this.conn = new SansIoConnection(this, this.opts.server.grpc);
        } else {
          const conn = new TunnelConnection(this);
          this.conn = conn;
          this.opts.server.http2.emit("connection", conn);
        }
        return;
      }
      case "data":
        if (!ev.drop && this.conn && !this.conn.destroyed) this.conn.deliver(ev.data);
        return;
      case "close": {
        const conn = this.conn;
        this.conn = undefined;
        if (conn) {
          conn.active = false;
          conn.destroy();
        }
        this.sendControl(this.tunnel.closed());
        return;
      }
    }
  }

  private sendControl(word: string): void {
    const ws = this.ws!;
    if (this.cipher) ws.send(this.cipher.sealControl(word), { binary: true });
    else ws.send(word, { binary: false });
  }

  /** Bytes the local HTTP/2 server wrote on `conn`. */
  localData(conn: LocalConnection, chunk: Uint8Array, cb: (err?: Error | null) => void): void {
    const ws = this.ws;
    if (chunk.length === 0 || !conn.active || this.phase !== "live" || !ws || !this.tunnel.canSendData() || conn.eofSent) {
      cb(); // the connection is over: its late bytes go nowhere (5.4)
      return;
    }
    let pending = 0;
    for (let at = 0; at < chunk.length; at += MAX_DATA_BYTES) {
      const piece = chunk.subarray(at, Math.min(chunk.length, at + MAX_DATA_BYTES));
      this.tunnel.sendData(piece.length);
      const msg = this.cipher ? this.cipher.sealData(piece) : piece;
      pending += 1;
      const stuck = this.timer(SEND_TIMEOUT_MS, () => this.fail(new ProtocolError(CloseCode.GOING_AWAY, "a message could not be sent within 60 s")));
      // A send error ends the session (the close event follows); the bytes are dropped (5.4).
      ws.send(msg, { binary: true }, () => {
        this.clearTimer(stuck);
        pending -= 1;
        if (pending === 0) cb();
      });
    }
    if (pending === 0) cb();
  }

  /** The local HTTP/2 server ended `conn` (end of its writes, or the stream destroyed). */
  localEof(conn: LocalConnection): void {
    if (conn.eofSent) return;
    conn.eofSent = true;
    if (conn.active && this.phase === "live" && this.tunnel.state === "OPEN") this.sendControl(this.tunnel.eof());
  }

  private startKeepalive(): void {
    const every = this.opts.keepaliveMs ?? KEEPALIVE_MS;
    this.keepalive = setInterval(() => {
      if (this.phase !== "live" || this.answerTimer !== undefined) return;
      if (this.cipher) {
        const seq = this.monitor.beat();
        this.ws!.send(this.cipher.sealHeartbeat(seq, false), { binary: true });
        this.answerTimer = this.timer(KEEPALIVE_TIMEOUT_MS, () =>
          this.fail(new ProtocolError(CloseCode.GOING_AWAY, "no sealed heartbeat answer within 10 s: the hub is gone or a relay is answering for it")),
        );
      } else {
        this.ws!.ping();
        this.answerTimer = this.timer(KEEPALIVE_TIMEOUT_MS, () => this.fail(new ProtocolError(CloseCode.GOING_AWAY, "no pong within 10 s")));
      }
    }, every);
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
    const ws = this.ws;
    if (!ws || this.phase === "over") return;
    const sent = code;
    this.phase = "over";
    this.dropConnection();
    if (ws.readyState === WebSocket.OPEN || ws.readyState === WebSocket.CONNECTING) {
      try {
        ws.close(code, closeReason(reason));
      } catch {
        ws.terminate();
      }
    }
    this.timer(5000, () => ws.terminate());
    // A refusal we send with a permanent code (4104, 4103) is as final as one we receive.
    this.ended = { established: this.established, code: sent, reason, fatal: closeClass(code) === "permanent" };
  }

  private dropConnection(): void {
    const conn = this.conn;
    this.conn = undefined;
    if (conn) {
      conn.active = false;
      conn.destroy();
    }
  }

  private finish(end: SessionEnd): void {
    if (this.keepalive) clearInterval(this.keepalive);
    for (const t of this.timers) clearTimeout(t);
    this.timers.clear();
    this.dropConnection();
    this.phase = "over";
    const result = this.ended ?? end;
    this.ended = result;
    this.resolve(result);
  }
}
