// One session in a web page: the browser's WebSocket (PROTOCOL.md 2, 3), the handshake (4),
// the end-to-end channel (4.5), tunnel control (5) with each "open" served by the sans-IO
// HTTP/2 + gRPC server of clients/ts/src/h2, the sealed heartbeat (6) and close codes (7).
// WebCrypto is asynchronous: received messages are handled one after another (a promise
// chain), and what is sent goes out in the order it was sealed.

import type { GrpcServer, GrpcServerConnection } from "../../ts/src/h2/grpc.js";
import { CloseCode, closeClass, LocalProtocolError, ProtocolError } from "../../ts/src/worker/bytes_core.js";
import { HeartbeatMonitor } from "../../ts/src/worker/channel_core.js";
import type { HandshakeOptions, HelloFacts } from "../../ts/src/worker/handshake_core.js";
import { MAX_DATA_BYTES, WorkerTunnel } from "../../ts/src/worker/tunnel.js";
import type { WebCipher } from "./crypto.js";
import { WebHandshake } from "./handshake.js";
import type { WebWallet } from "./wallet.js";

export const TUNNEL_SUBPROTOCOL = "kvasir.tunnel.v1";
export const KEEPALIVE_MS = 15_000;
export const KEEPALIVE_TIMEOUT_MS = 10_000;
export const HANDSHAKE_TIMEOUT_MS = 15_000;

export interface WebSessionOptions {
  url: string;
  grpc: GrpcServer;
  wallet: WebWallet;
  hello: HelloFacts;
  handshake: HandshakeOptions;
  log: (line: string) => void;
  /** Called when the session is live (the accept checked). */
  onLive?: (sessionId: string, encrypted: boolean) => void;
  keepaliveMs?: number;
}

export interface WebSessionEnd {
  established: boolean;
  /** The close code (received, or sent by this side); undefined when the WebSocket never opened. */
  code: number | undefined;
  reason: string;
  /** This side closed (a refusal of its own, or stop()). */
  local: boolean;
  /** Dialling again unchanged gets the same answer. */
  fatal: boolean;
}

/** Truncate a close reason to 120 bytes of UTF-8 (PROTOCOL.md 7). */
function closeReason(reason: string): string {
  let r = reason;
  const enc = new TextEncoder();
  while (enc.encode(r).byteLength > 120) r = r.slice(0, -1);
  return r;
}

/** One tunnel connection, served by the sans-IO gRPC server. */
interface LocalConnection {
  grpc: GrpcServerConnection;
  /** Still the tunnel's current connection (no "close" yet). */
  active: boolean;
  eofSent: boolean;
}

function textInHandshake(): ProtocolError {
  return new ProtocolError(CloseCode.PROTOCOL_ERROR, "a text message during the handshake");
}

type Phase = "connecting" | "challenge" | "accept" | "live" | "over";

export class WebSession {
  private ws: WebSocket | undefined;
  private phase: Phase = "connecting";
  private hs: WebHandshake | undefined;
  private cipher: WebCipher | undefined;
  private readonly tunnel = new WorkerTunnel();
  private conn: LocalConnection | undefined;
  private readonly monitor = new HeartbeatMonitor();
  private received: Promise<void> = Promise.resolve();
  private sending: Promise<void> = Promise.resolve();
  private timers = new Set<ReturnType<typeof setTimeout>>();
  private keepalive: ReturnType<typeof setInterval> | undefined;
  private answerTimer: ReturnType<typeof setTimeout> | undefined;
  private established = false;
  private ended: WebSessionEnd | undefined;
  private resolve!: (end: WebSessionEnd) => void;
  readonly done: Promise<WebSessionEnd>;
  sessionId = "";

  constructor(private readonly opts: WebSessionOptions) {
    this.done = new Promise((r) => (this.resolve = r));
  }

  get encrypted(): boolean {
    return this.cipher !== undefined;
  }

  private timer(ms: number, fn: () => void): ReturnType<typeof setTimeout> {
    const t = setTimeout(() => {
      this.timers.delete(t);
      fn();
    }, ms);
    this.timers.add(t);
    return t;
  }

  private clearTimer(t: ReturnType<typeof setTimeout> | undefined): void {
    if (t === undefined) return;
    clearTimeout(t);
    this.timers.delete(t);
  }

  /** Dial and run until the WebSocket closes; resolves with how it ended. */
  async run(): Promise<WebSessionEnd> {
    try {
      this.hs = await WebHandshake.create(this.opts.hello, this.opts.wallet, this.opts.handshake);
    } catch (exc) {
      this.finish({ established: false, code: undefined, reason: String(exc), local: true, fatal: true });
      return this.done;
    }
    let ws: WebSocket;
    try {
      ws = new WebSocket(this.opts.url, [TUNNEL_SUBPROTOCOL]);
    } catch (exc) {
      this.finish({ established: false, code: undefined, reason: `bad URL: ${String(exc)}`, local: true, fatal: true });
      return this.done;
    }
    this.ws = ws;
    ws.binaryType = "arraybuffer";
    const handshakeTimer = this.timer(HANDSHAKE_TIMEOUT_MS, () => {
      if (!this.established) this.fail(new ProtocolError(CloseCode.HANDSHAKE_TIMEOUT, "handshake timed out"));
    });
    ws.onopen = () => {
      if (ws.protocol !== TUNNEL_SUBPROTOCOL) {
        const why = `the server chose subprotocol ${JSON.stringify(ws.protocol)}, not one offered`;
        this.fail(new ProtocolError(CloseCode.PROTOCOL_ERROR, why));
        return;
      }
      this.phase = "challenge";
    };
    ws.onmessage = (ev: MessageEvent) => {
      const msg = typeof ev.data === "string" ? ev.data : new Uint8Array(ev.data as ArrayBuffer);
      this.received = this.received.then(() => this.onMessage(msg)).catch((exc: unknown) => this.fail(exc));
    };
    ws.onerror = () => {
      // The browser says no more than this (the close event follows, usually 1006).
      if (this.phase === "connecting") this.opts.log(`could not connect to ${this.opts.url}`);
    };
    ws.onclose = (ev: CloseEvent) => {
      this.clearTimer(handshakeTimer);
      const never = this.phase === "connecting" && ev.code === 1006;
      const unreachable = `could not connect to ${this.opts.url} (refused, no server, or a TLS or HTTP error)`;
      const reason = never ? unreachable : ev.reason;
      const fatal = closeClass(ev.code) === "permanent";
      this.finish({ established: this.established, code: never ? undefined : ev.code, reason, local: false, fatal });
    };
    return this.done;
  }

  private async onMessage(msg: Uint8Array | string): Promise<void> {
    switch (this.phase) {
      case "challenge": {
        if (typeof msg === "string") throw textInHandshake();
        this.phase = "accept";
        const hello = await this.hs!.receiveChallenge(msg);
        this.ws!.send(hello);
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
        this.opts.log(
          `session ${acc.sessionId} live with hub ${acc.hubKey.slice(0, 16)}…` +
            (acc.cipher ? ", encrypted end to end (AES-256-GCM)" : ", not encrypted"),
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
        return;
    }
  }

  /** Send what `what` gives, after everything sent before it. */
  private send(what: Promise<Uint8Array> | Uint8Array | string): void {
    const ws = this.ws!;
    this.sending = this.sending
      .then(async () => {
        const m = await what;
        if (ws.readyState === WebSocket.OPEN) ws.send(typeof m === "string" ? m : (m as Uint8Array<ArrayBuffer>));
      })
      .catch((exc: unknown) => this.fail(exc));
  }

  private onTunnel(msg: Uint8Array | string): void {
    const ev = this.tunnel.receive(msg);
    switch (ev.kind) {
      case "open": {
        const conn = { active: true, eofSent: false } as LocalConnection;
        conn.grpc = this.opts.grpc.connect({
          write: (bytes) => this.localData(conn, bytes),
          close: () => this.localEof(conn),
        });
        this.conn = conn;
        return;
      }
      case "data":
        if (!ev.drop && this.conn) this.conn.grpc.receive(ev.data.slice());
        return;
      case "close": {
        this.dropConnection();
        this.sendControl(this.tunnel.closed());
        return;
      }
    }
  }

  private sendControl(word: string): void {
    this.send(this.cipher ? this.cipher.sealControl(word) : word);
  }

  private localData(conn: { active: boolean; eofSent: boolean }, chunk: Uint8Array): void {
    if (chunk.length === 0 || !conn.active || conn.eofSent) return;
    if (this.phase !== "live" || !this.tunnel.canSendData()) return; // over: late bytes go nowhere (5.4)
    for (let at = 0; at < chunk.length; at += MAX_DATA_BYTES) {
      const piece = chunk.slice(at, Math.min(chunk.length, at + MAX_DATA_BYTES));
      this.tunnel.sendData(piece.length);
      this.send(this.cipher ? this.cipher.sealData(piece) : piece);
    }
  }

  private localEof(conn: { active: boolean; eofSent: boolean }): void {
    if (conn.eofSent) return;
    conn.eofSent = true;
    if (conn.active && this.phase === "live" && this.tunnel.state === "OPEN") this.sendControl(this.tunnel.eof());
  }

  private startKeepalive(): void {
    // A browser cannot send a WebSocket ping (it answers the hub's); on an encrypted session the
    // sealed heartbeat checks the hub end to end (4.5, 6).
    if (!this.cipher) return;
    const every = this.opts.keepaliveMs ?? KEEPALIVE_MS;
    this.keepalive = setInterval(() => {
      if (this.phase !== "live" || this.answerTimer !== undefined || !this.cipher) return;
      const seq = this.monitor.beat();
      this.send(this.cipher.sealHeartbeat(seq, false));
      this.answerTimer = this.timer(KEEPALIVE_TIMEOUT_MS, () =>
        this.fail(
          new ProtocolError(
            CloseCode.GOING_AWAY,
            "no sealed heartbeat answer within 10 s: the hub is gone or a relay is answering for it",
          ),
        ),
      );
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
    this.phase = "over";
    this.dropConnection();
    this.ended = { established: this.established, code, reason, local: true, fatal: closeClass(code) === "permanent" };
    if (ws.readyState === WebSocket.OPEN || ws.readyState === WebSocket.CONNECTING) {
      // A page may send 1000 and 3000-4999 only: another code (1001, 1002, 1008, 1011) goes as
      // 1000 with the code leading its reason.
      const allowed = code === 1000 || (code >= 3000 && code <= 4999);
      ws.close(allowed ? code : 1000, closeReason(allowed ? reason : `${code} ${reason}`));
    }
    this.timer(5000, () => this.finish(this.ended!));
  }

  private dropConnection(): void {
    const conn = this.conn;
    this.conn = undefined;
    if (conn) {
      conn.active = false;
      conn.grpc.close();
    }
  }

  private finish(end: WebSessionEnd): void {
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
