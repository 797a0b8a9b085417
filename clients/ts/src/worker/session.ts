// One session of the Node worker: the WebSocket of the `ws` package (PROTOCOL.md 2, 3) under the
// protocol logic of session_core.ts (the handshake, the end-to-end channel, tunnel control,
// keepalive, close codes), with each "open" spliced into node:http2's server or src/h2's sans-IO one.

import { Duplex } from "node:stream";

import WebSocket from "ws";

import { CloseCode, closeClass, ProtocolError } from "./bytes.js";
import { WorkerHandshake, type HandshakeOptions, type HelloInfo } from "./handshake.js";
import type { ExpertServer } from "./service.js";
import {
  closeReason,
  HANDSHAKE_TIMEOUT_MS,
  type LocalConnection,
  SansIoConnection,
  SessionCore,
  type SessionEnd,
  SessionHandle,
  TUNNEL_SUBPROTOCOLS,
} from "./session_core.js";

export {
  HANDSHAKE_TIMEOUT_MS,
  KEEPALIVE_MS,
  KEEPALIVE_TIMEOUT_MS,
  type SessionEnd,
  TUNNEL_SUBPROTOCOL,
  TUNNEL_SUBPROTOCOLS,
} from "./session_core.js";
/** Either side closes with 1009 on a larger message. */
export const MAX_MESSAGE_BYTES = 4 << 20;
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

/** The local end of one tunnel connection as a stream: what node:http2's server reads and writes. */
class TunnelConnection extends Duplex implements LocalConnection {
  active = true;
  eofSent = false;

  constructor(private readonly core: SessionCore) {
    super({ allowHalfOpen: true });
  }

  deliver(data: Uint8Array): void {
    this.push(Buffer.from(data));
  }

  override _read(): void {}

  override _write(chunk: Buffer, _enc: BufferEncoding, cb: (err?: Error | null) => void): void {
    this.core.localData(this, chunk, () => cb());
  }

  override _final(cb: (err?: Error | null) => void): void {
    this.core.localEof(this);
    cb();
  }

  override _destroy(err: Error | null, cb: (err?: Error | null) => void): void {
    this.core.localEof(this);
    cb(err);
  }
}

export class Session extends SessionHandle {
  constructor(private readonly opts: SessionOptions) {
    super(
      new SessionCore({
        log: opts.log,
        ...(opts.keepaliveMs !== undefined ? { keepaliveMs: opts.keepaliveMs } : {}),
        connect: (core) => {
          if (opts.http2 === "sans-io") return new SansIoConnection(core, opts.server.grpc);
          const conn = new TunnelConnection(core);
          opts.server.http2.emit("connection", conn);
          return conn;
        },
      }),
    );
  }

  /** Dial and run until the WebSocket closes; resolves with how it ended. */
  run(): Promise<SessionEnd> {
    const core = this.core;
    const ws = new WebSocket(this.opts.url, TUNNEL_SUBPROTOCOLS, {
      perMessageDeflate: false,
      maxPayload: MAX_MESSAGE_BYTES,
      handshakeTimeout: HANDSHAKE_TIMEOUT_MS,
      ...(this.opts.ca ? { ca: this.opts.ca } : {}),
    });
    ws.binaryType = "nodebuffer";
    const stuck = (): void =>
      core.fail(new ProtocolError(CloseCode.GOING_AWAY, "a message could not be sent within 60 s"));
    core.attach(
      {
        send: (msg, sent) => {
          if (!sent) {
            ws.send(msg, { binary: typeof msg !== "string" });
            return;
          }
          const t = core.timer(SEND_TIMEOUT_MS, stuck);
          // A send error ends the session (the close event follows); the bytes are dropped (5.4).
          ws.send(msg, { binary: true }, () => {
            core.clearTimer(t);
            sent();
          });
        },
        ping: () => ws.ping(),
        // ws queues what the socket has not taken yet: the core holds incoming calls above the mark.
        bufferedAmount: () => ws.bufferedAmount,
        close: (code, reason) => {
          if (ws.readyState !== WebSocket.OPEN && ws.readyState !== WebSocket.CONNECTING) return;
          try {
            ws.close(code, closeReason(reason));
          } catch {
            ws.terminate();
          }
        },
        abort: () => ws.terminate(),
      },
      new WorkerHandshake(this.opts.hello, this.opts.handshake),
    );
    ws.on("unexpected-response", (req, res) => {
      const status = res.statusCode ?? 0;
      const after = Number(res.headers["retry-after"]);
      let body = "";
      res.setEncoding("utf8");
      res.on("data", (c: string) => (body += c.slice(0, 200)));
      const finish = (): void => {
        req.destroy();
        core.finish({
          established: false,
          code: status === 503 ? CloseCode.TRY_AGAIN_LATER : undefined,
          reason: `HTTP ${status} ${res.statusMessage ?? ""}${body ? `: ${body.trim().slice(0, 200)}` : ""}`,
          local: false,
          fatal: status >= 400 && status < 500 && status !== 429,
          ...(Number.isFinite(after) && after > 0 ? { retryAfterMs: after * 1000 } : {}),
        });
      };
      res.on("end", finish);
      res.on("error", finish);
      setTimeout(finish, 2000).unref();
    });
    // ws itself refuses an answer without one of the offered subprotocols; the core checks anyway (3).
    ws.on("open", () => core.opened(ws.protocol));
    ws.on("message", (data: Buffer, isBinary: boolean) => {
      core.receive(isBinary ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength) : data.toString("utf8"));
    });
    ws.on("pong", () => core.pong());
    ws.on("error", (err) => {
      if (!core.connecting) return;
      core.finish({ established: false, code: undefined, reason: err.message, local: false, fatal: false });
    });
    ws.on("close", (code: number, reason: Buffer) => {
      const fatal = closeClass(code) === "permanent";
      core.finish({ established: core.isEstablished, code, reason: reason.toString("utf8"), local: false, fatal });
    });
    return this.done;
  }
}
