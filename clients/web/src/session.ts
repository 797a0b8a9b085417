// One session in a web page: the browser's WebSocket (PROTOCOL.md 2, 3) under the protocol logic
// of clients/ts/src/worker/session_core.ts (the handshake, the end-to-end channel, tunnel control
// with each "open" served by the sans-IO HTTP/2 + gRPC server of clients/ts/src/h2, the sealed
// heartbeat, close codes). WebCrypto is asynchronous: the core handles received messages one
// after another, and what is sent goes out in the order it was sealed. WebSocket.send never
// blocks: the core reads bufferedAmount and holds incoming calls while replies queue (send
// backpressure, SEND_HIGH_WATER_BYTES).

import type { GrpcServer } from "../../ts/src/h2/grpc.js";
import { closeClass } from "../../ts/src/worker/bytes_core.js";
import type { HandshakeOptions, HelloFacts } from "../../ts/src/worker/handshake_core.js";
import {
  closeReason,
  SansIoConnection,
  SessionCore,
  type SessionEnd,
  SessionHandle,
  TUNNEL_SUBPROTOCOL,
} from "../../ts/src/worker/session_core.js";
import { WebHandshake } from "./handshake.js";
import type { WebWallet } from "./wallet.js";

export {
  HANDSHAKE_TIMEOUT_MS,
  KEEPALIVE_MS,
  KEEPALIVE_TIMEOUT_MS,
  SEND_HIGH_WATER_BYTES,
  SEND_LOW_WATER_BYTES,
  SEND_STALL_TIMEOUT_MS,
  TUNNEL_SUBPROTOCOL,
} from "../../ts/src/worker/session_core.js";

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

export type WebSessionEnd = SessionEnd;

export class WebSession extends SessionHandle {
  constructor(private readonly opts: WebSessionOptions) {
    super(
      new SessionCore({
        log: opts.log,
        connect: (core) => new SansIoConnection(core, opts.grpc),
        ...(opts.onLive ? { onLive: opts.onLive } : {}),
        ...(opts.keepaliveMs !== undefined ? { keepaliveMs: opts.keepaliveMs } : {}),
      }),
    );
  }

  /** Dial and run until the WebSocket closes; resolves with how it ended. */
  async run(): Promise<WebSessionEnd> {
    const core = this.core;
    let hs: WebHandshake;
    try {
      hs = await WebHandshake.create(this.opts.hello, this.opts.wallet, this.opts.handshake);
    } catch (exc) {
      core.finish({ established: false, code: undefined, reason: String(exc), local: true, fatal: true });
      return this.done;
    }
    let ws: WebSocket;
    try {
      ws = new WebSocket(this.opts.url, [TUNNEL_SUBPROTOCOL]);
    } catch (exc) {
      core.finish({ established: false, code: undefined, reason: `bad URL: ${String(exc)}`, local: true, fatal: true });
      return this.done;
    }
    ws.binaryType = "arraybuffer";
    core.attach(
      {
        send: (m, sent) => {
          if (ws.readyState === WebSocket.OPEN) ws.send(typeof m === "string" ? m : (m as Uint8Array<ArrayBuffer>));
          sent?.();
        },
        // No ping: a browser cannot send one (it answers the hub's).
        // send() never blocks: what the hub has not read yet queues here (the core's bound).
        bufferedAmount: () => ws.bufferedAmount,
        close: (code, reason) => {
          if (ws.readyState !== WebSocket.OPEN && ws.readyState !== WebSocket.CONNECTING) return;
          // A page may send 1000 and 3000-4999 only: another code (1001, 1002, 1008, 1011) goes as
          // 1000 with the code leading its reason.
          const allowed = code === 1000 || (code >= 3000 && code <= 4999);
          ws.close(allowed ? code : 1000, closeReason(allowed ? reason : `${code} ${reason}`));
        },
        // The close did not complete: the session ends as this side closed it.
        abort: () => core.finish({ established: core.isEstablished, code: undefined, reason: "",
          local: true, fatal: false }),
      },
      hs,
    );
    ws.onopen = () => core.opened(ws.protocol);
    ws.onmessage = (ev: MessageEvent) => {
      core.receive(typeof ev.data === "string" ? ev.data : new Uint8Array(ev.data as ArrayBuffer));
    };
    ws.onerror = () => {
      // The browser says no more than this (the close event follows, usually 1006).
      if (core.connecting) this.opts.log(`could not connect to ${this.opts.url}`);
    };
    ws.onclose = (ev: CloseEvent) => {
      const never = core.connecting && ev.code === 1006;
      const unreachable = `could not connect to ${this.opts.url} (refused, no server, or a TLS or HTTP error)`;
      const reason = never ? unreachable : ev.reason;
      const fatal = closeClass(ev.code) === "permanent";
      core.finish({ established: core.isEstablished, code: never ? undefined : ev.code, reason, local: false, fatal });
    };
    return this.done;
  }
}
