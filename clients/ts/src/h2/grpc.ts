// A gRPC server (https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md) on the sans-IO
// HTTP/2 connection of connection.ts: length-prefixed messages, `:path` routing to unary and
// streaming handlers over raw message bytes, response headers and trailers (grpc-status,
// percent-encoded grpc-message), grpc-timeout deadlines, message size limits and cancellation.
// Plain TypeScript (Uint8Array, AbortController, setTimeout): it runs in a browser as in Node.
// The caller moves the bytes: GrpcServer.connect(transport) per connection, then receive().

import { H2ServerConnection, type H2Event, type H2ServerOptions, type Header } from "./connection.js";

/** gRPC status codes. */
export const Status = {
  OK: 0,
  CANCELLED: 1,
  UNKNOWN: 2,
  INVALID_ARGUMENT: 3,
  DEADLINE_EXCEEDED: 4,
  NOT_FOUND: 5,
  ALREADY_EXISTS: 6,
  PERMISSION_DENIED: 7,
  RESOURCE_EXHAUSTED: 8,
  FAILED_PRECONDITION: 9,
  ABORTED: 10,
  OUT_OF_RANGE: 11,
  UNIMPLEMENTED: 12,
  INTERNAL: 13,
  UNAVAILABLE: 14,
  DATA_LOSS: 15,
  UNAUTHENTICATED: 16,
} as const;

/** Throw from a handler to end the call with `code` and `message`. */
export class GrpcError extends Error {
  override name = "GrpcError";
  constructor(
    readonly code: number,
    message: string,
  ) {
    super(message);
  }
}

export interface CallContext {
  /** The method's path, /package.Service/Method. */
  readonly path: string;
  /** The request's header fields (pseudo-headers included). */
  readonly headers: readonly Header[];
  /** Date.now() past which the call is over (grpc-timeout), or undefined. */
  readonly deadline: number | undefined;
  /** Aborted when the call ends early: the client cancelled it, its deadline passed, the
   * connection went away, or it failed. */
  readonly signal: AbortSignal;
}

export type UnaryHandler = (request: Uint8Array, ctx: CallContext) => Promise<Uint8Array> | Uint8Array;
/** A streaming handler (client, server or bidirectional streaming: the shapes are the same on the
 * wire): it reads requests as they come and yields responses. */
export type StreamHandler = (requests: AsyncIterable<Uint8Array>, ctx: CallContext) => AsyncIterable<Uint8Array>;

export interface GrpcServerOptions {
  /** The largest request message taken; a larger one ends the call with RESOURCE_EXHAUSTED (4 MiB). */
  maxReceiveMessageBytes?: number;
  /** The largest response message sent; a larger one ends the call with RESOURCE_EXHAUSTED (4 MiB). */
  maxSendMessageBytes?: number;
  /** A streaming handler's next response waits while this many bytes of its stream are queued
   * behind flow control (default 1 MiB). */
  highWaterMark?: number;
  h2?: H2ServerOptions;
}

/** Where a connection's bytes go: `write` the server's bytes to the peer; `close` the transport
 * (after a connection error, once its GOAWAY is written). */
export interface Transport {
  write(bytes: Uint8Array): void;
  close(): void;
}

type Route = { kind: "unary"; handler: UnaryHandler } | { kind: "stream"; handler: StreamHandler };

/** Percent-encode a grpc-message value: bytes outside 0x20-0x7E, and '%', as %XX of UTF-8. */
export function percentEncode(message: string): string {
  const bytes = new TextEncoder().encode(message);
  let out = "";
  for (const b of bytes) {
    if (b >= 0x20 && b <= 0x7e && b !== 0x25) out += String.fromCharCode(b);
    else out += `%${b.toString(16).toUpperCase().padStart(2, "0")}`;
  }
  return out;
}

/** The inverse of percentEncode (malformed escapes are kept as they are). */
export function percentDecode(value: string): string {
  const bytes: number[] = [];
  for (let i = 0; i < value.length; i++) {
    const c = value.charCodeAt(i);
    if (c === 0x25 && /^[0-9A-Fa-f]{2}$/.test(value.slice(i + 1, i + 3))) {
      bytes.push(parseInt(value.slice(i + 1, i + 3), 16));
      i += 2;
    } else {
      bytes.push(c & 0xff);
    }
  }
  return new TextDecoder().decode(Uint8Array.from(bytes));
}

const TIMEOUT_UNIT_MS: Record<string, number> = { H: 3_600_000, M: 60_000, S: 1000, m: 1, u: 1e-3, n: 1e-6 };

/** grpc-timeout (`1..8 digits` + H M S m u n) in milliseconds, or undefined when malformed. */
export function parseGrpcTimeout(value: string): number | undefined {
  const m = /^(\d{1,8})([HMSmun])$/.exec(value);
  if (!m) return undefined;
  return Number(m[1]) * TIMEOUT_UNIT_MS[m[2]!]!;
}

/** The 5-byte prefix and the message (uncompressed). */
export function frameMessage(message: Uint8Array): Uint8Array {
  const out = new Uint8Array(5 + message.length);
  new DataView(out.buffer).setUint32(1, message.length);
  out.set(message, 5);
  return out;
}

/** Request messages of one call, as an async iterable its handler reads. */
class MessageQueue implements AsyncIterable<Uint8Array> {
  private items: Uint8Array[] = [];
  /** Bytes of the messages waiting to be read. */
  bytes = 0;
  /** Called after the handler took a message. */
  onTake: (() => void) | undefined;
  private ended = false;
  private error: Error | undefined;
  private waiter: (() => void) | undefined;

  push(m: Uint8Array): void {
    this.items.push(m);
    this.bytes += m.length;
    this.wake();
  }

  end(): void {
    this.ended = true;
    this.wake();
  }

  fail(err: Error): void {
    this.error ??= err;
    this.wake();
  }

  private wake(): void {
    const w = this.waiter;
    this.waiter = undefined;
    w?.();
  }

  /** The next message, or undefined at the end; throws after fail(). */
  async next(): Promise<Uint8Array | undefined> {
    for (;;) {
      if (this.error) throw this.error;
      const m = this.items.shift();
      if (m) {
        this.bytes -= m.length;
        this.onTake?.();
        return m;
      }
      if (this.ended) return undefined;
      await new Promise<void>((r) => (this.waiter = r));
    }
  }

  async *[Symbol.asyncIterator](): AsyncIterator<Uint8Array> {
    for (;;) {
      const m = await this.next();
      if (m === undefined) return;
      yield m;
    }
  }
}

class Call {
  readonly queue = new MessageQueue();
  readonly abort = new AbortController();
  readonly ctx: CallContext;
  /** Received bytes of an incomplete message. */
  chunks: Uint8Array[] = [];
  buffered = 0;
  /** The length of the message being received, once its prefix is in. */
  expect = -1;
  headersSent = false;
  done = false;
  /** Received bytes not yet given back to the client's flow-control window (the handler is behind). */
  unacked = 0;
  timer: ReturnType<typeof setTimeout> | undefined;
  drainWaiter: (() => void) | undefined;

  constructor(
    readonly id: number,
    path: string,
    headers: readonly Header[],
    deadline: number | undefined,
  ) {
    this.ctx = { path, headers, deadline, signal: this.abort.signal };
  }
}

export class GrpcServer {
  private readonly routes = new Map<string, Route>();
  readonly maxReceiveMessageBytes: number;
  readonly maxSendMessageBytes: number;
  readonly highWaterMark: number;

  constructor(readonly opts: GrpcServerOptions = {}) {
    this.maxReceiveMessageBytes = opts.maxReceiveMessageBytes ?? 4 << 20;
    this.maxSendMessageBytes = opts.maxSendMessageBytes ?? 4 << 20;
    this.highWaterMark = opts.highWaterMark ?? 1 << 20;
  }

  /** Serve `path` (/package.Service/Method) with a unary handler. */
  unary(path: string, handler: UnaryHandler): this {
    this.routes.set(path, { kind: "unary", handler });
    return this;
  }

  /** Serve `path` with a streaming handler. */
  stream(path: string, handler: StreamHandler): this {
    this.routes.set(path, { kind: "stream", handler });
    return this;
  }

  route(path: string): Route | undefined {
    return this.routes.get(path);
  }

  /** A new HTTP/2 connection whose bytes travel over `transport`; its server preface is written at once. */
  connect(transport: Transport): GrpcServerConnection {
    return new GrpcServerConnection(this, transport);
  }
}

export class GrpcServerConnection {
  readonly h2: H2ServerConnection;
  private readonly calls = new Map<number, Call>();
  private closed = false;

  constructor(
    private readonly server: GrpcServer,
    private readonly transport: Transport,
  ) {
    this.h2 = new H2ServerConnection(server.opts.h2);
    this.flush();
  }

  /** Bytes from the client. They are referenced, not copied: do not reuse the buffer. */
  receive(bytes: Uint8Array): void {
    if (this.closed) return;
    const events = this.h2.receiveData(bytes);
    for (const ev of events) this.onEvent(ev);
    this.flush();
    this.wakeWriters();
  }

  /** The transport is gone: every call is cancelled, nothing more is written. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.cancelAll("the connection closed");
  }

  private cancelAll(why: string): void {
    for (const call of [...this.calls.values()]) this.cancel(call, why);
  }

  /** Calls in progress. */
  get activeCalls(): number {
    return this.calls.size;
  }

  private flush(): void {
    if (this.closed) return;
    const out = this.h2.dataToSend();
    if (out.length) this.transport.write(out);
    if (this.h2.isClosed) {
      // A connection error: its GOAWAY is written above; the transport goes too.
      this.closed = true;
      this.cancelAll("connection error");
      this.transport.close();
    }
  }

  private onEvent(ev: H2Event): void {
    switch (ev.type) {
      case "request":
        this.onRequest(ev.streamId, ev.headers);
        return;
      case "data": {
        const call = this.calls.get(ev.streamId);
        if (!call || call.done) {
          this.h2.acknowledgeReceivedData(ev.streamId, ev.flowControlledLength);
          return;
        }
        // Backpressure: the window is given back while the handler keeps up (messages waiting for
        // it under the high-water mark), else when it takes them.
        call.unacked += ev.flowControlledLength;
        this.onData(call, ev.data);
        this.release(call);
        return;
      }
      case "streamEnded": {
        const call = this.calls.get(ev.streamId);
        if (!call || call.done) return;
        if (call.buffered > 0) this.finish(call, Status.INTERNAL, "the request ended inside a message");
        else call.queue.end();
        return;
      }
      case "streamReset": {
        const call = this.calls.get(ev.streamId);
        if (call) this.cancel(call, ev.remote ? "the client cancelled the call" : (ev.message ?? "stream reset"));
        return;
      }
      case "connectionError":
        this.cancelAll(`connection error: ${ev.message}`); // receive() then writes the GOAWAY and closes
        return;
      default:
        return;
    }
  }

  private onRequest(id: number, headers: Header[]): void {
    const get = (name: string): string | undefined => headers.find(([n]) => n === name)?.[1];
    const contentType = get("content-type") ?? "";
    if (!/^application\/grpc([+;]|$)/.test(contentType)) {
      // Not gRPC: HTTP 415 (PROTOCOL-HTTP2.md), with a status for gRPC clients that look.
      this.h2.sendHeaders(id, [
        [":status", "415"],
        ["grpc-status", String(Status.UNKNOWN)],
        ["grpc-message", percentEncode(`invalid gRPC request content-type ${JSON.stringify(contentType)}`)],
      ], true);
      return;
    }
    const path = get(":path")!;
    const timeoutValue = get("grpc-timeout");
    const timeoutMs = timeoutValue === undefined ? undefined : parseGrpcTimeout(timeoutValue);
    const call = new Call(id, path, headers, timeoutMs === undefined ? undefined : Date.now() + timeoutMs);
    call.queue.onTake = () => {
      if (this.release(call)) this.flush();
    };
    this.calls.set(id, call);
    const method = get(":method");
    if (method !== "POST") return this.finish(call, Status.UNIMPLEMENTED, `method ${method} is not POST`);
    const route = this.server.route(path);
    if (!route) return this.finish(call, Status.UNIMPLEMENTED, `unknown method ${path}`);
    if (timeoutValue !== undefined && timeoutMs === undefined) {
      return this.finish(call, Status.INTERNAL, `malformed grpc-timeout ${JSON.stringify(timeoutValue)}`);
    }
    const encoding = get("grpc-encoding");
    if (encoding !== undefined && encoding !== "identity") {
      return this.finish(call, Status.UNIMPLEMENTED, `compression ${encoding} is not supported`, [
        ["grpc-accept-encoding", "identity"],
      ]);
    }
    if (timeoutMs !== undefined && timeoutMs < 2 ** 31) {
      call.timer = setTimeout(() => {
        this.finish(call, Status.DEADLINE_EXCEEDED, "deadline exceeded");
        this.flush();
      }, timeoutMs);
    }
    void this.run(call, route);
  }

  private onData(call: Call, data: Uint8Array): void {
    call.chunks.push(data);
    call.buffered += data.length;
    const max = this.server.maxReceiveMessageBytes;
    for (;;) {
      if (call.expect < 0) {
        if (call.buffered < 5) return;
        const head = this.takeBytes(call, 5);
        const flag = head[0]!;
        const len = new DataView(head.buffer, head.byteOffset, 5).getUint32(1);
        if (flag === 1) {
          return this.finish(call, Status.INTERNAL, "a compressed message, and no grpc-encoding is in use");
        }
        if (flag !== 0) return this.finish(call, Status.INTERNAL, `message flags ${flag}`);
        if (len > max) {
          return this.finish(call, Status.RESOURCE_EXHAUSTED, `received message larger than max (${len} vs. ${max})`);
        }
        call.expect = len;
      }
      if (call.buffered < call.expect) return;
      const msg = this.takeBytes(call, call.expect);
      call.expect = -1;
      call.queue.push(msg);
    }
  }

  /** Give `call`'s received bytes back to the client unless its handler is behind; true when some were. */
  private release(call: Call): boolean {
    if (call.unacked === 0 || (!call.done && call.queue.bytes > this.server.highWaterMark)) return false;
    this.h2.acknowledgeReceivedData(call.id, call.unacked);
    call.unacked = 0;
    return true;
  }

  /** The next `n` received bytes of `call`, one copy at most. */
  private takeBytes(call: Call, n: number): Uint8Array {
    const first = call.chunks[0];
    let out: Uint8Array;
    if (first && first.length >= n) {
      out = first.subarray(0, n);
      if (first.length === n) call.chunks.shift();
      else call.chunks[0] = first.subarray(n);
    } else {
      out = new Uint8Array(n);
      let at = 0;
      while (at < n) {
        const c = call.chunks[0]!;
        const k = Math.min(c.length, n - at);
        out.set(c.subarray(0, k), at);
        at += k;
        if (k === c.length) call.chunks.shift();
        else call.chunks[0] = c.subarray(k);
      }
    }
    call.buffered -= n;
    return out;
  }

  private async run(call: Call, route: Route): Promise<void> {
    try {
      if (route.kind === "unary") {
        const req = await call.queue.next();
        if (req === undefined) throw new GrpcError(Status.INTERNAL, "no request message in a unary call");
        if ((await call.queue.next()) !== undefined) {
          throw new GrpcError(Status.INTERNAL, "more than one request message in a unary call");
        }
        const res = await route.handler(req, call.ctx);
        if (call.done) return;
        this.sendMessage(call, res);
      } else {
        for await (const res of route.handler(call.queue, call.ctx)) {
          if (call.done) return;
          this.sendMessage(call, res);
          this.flush();
          await this.writable(call);
        }
        if (call.done) return;
      }
      this.finish(call, Status.OK, "");
    } catch (exc) {
      if (call.done) return;
      if (exc instanceof GrpcError) this.finish(call, exc.code, exc.message);
      else this.finish(call, Status.UNKNOWN, exc instanceof Error ? exc.message : String(exc));
    }
    this.flush();
    this.wakeWriters();
  }

  private sendMessage(call: Call, message: Uint8Array): void {
    const max = this.server.maxSendMessageBytes;
    if (message.length > max) {
      throw new GrpcError(Status.RESOURCE_EXHAUSTED, `response message larger than max (${message.length} vs. ${max})`);
    }
    if (!this.h2.isStreamWritable(call.id)) throw new GrpcError(Status.CANCELLED, "the stream is closed");
    if (!call.headersSent) {
      call.headersSent = true;
      this.h2.sendHeaders(call.id, [
        [":status", "200"],
        ["content-type", "application/grpc"],
      ]);
    }
    this.h2.sendData(call.id, frameMessage(message));
  }

  /** Resolves once `call`'s queued bytes are at most the high-water mark (or it is over). */
  private writable(call: Call): Promise<void> {
    if (call.done || this.h2.queuedBytes(call.id) <= this.server.highWaterMark) return Promise.resolve();
    return new Promise((r) => (call.drainWaiter = r));
  }

  private wakeWriters(): void {
    for (const call of this.calls.values()) {
      if (call.drainWaiter && (call.done || this.h2.queuedBytes(call.id) <= this.server.highWaterMark)) {
        const w = call.drainWaiter;
        call.drainWaiter = undefined;
        w();
      }
    }
  }

  /** End `call` with a status: trailers (or a trailers-only response). */
  private finish(call: Call, code: number, message: string, extra: Header[] = []): void {
    if (call.done) return;
    this.settle(call);
    if (code !== Status.OK) {
      call.queue.fail(new GrpcError(code, message));
      call.abort.abort(new GrpcError(code, message));
    }
    if (!this.h2.isStreamWritable(call.id)) return;
    const status: Header[] = [["grpc-status", String(code)]];
    if (message) status.push(["grpc-message", percentEncode(message)]);
    if (call.headersSent) {
      this.h2.sendHeaders(call.id, [...status, ...extra], true);
    } else {
      const head: Header[] = [[":status", "200"], ["content-type", "application/grpc"]];
      this.h2.sendHeaders(call.id, [...head, ...status, ...extra], true);
    }
  }

  /** The call ended without an answer (client reset, connection gone): abort its handler. */
  private cancel(call: Call, why: string): void {
    if (call.done) return;
    this.settle(call);
    const err = new GrpcError(Status.CANCELLED, why);
    call.queue.fail(err);
    call.abort.abort(err);
  }

  private settle(call: Call): void {
    call.done = true;
    this.release(call); // the connection's window, at least, comes back
    if (call.timer !== undefined) clearTimeout(call.timer);
    this.calls.delete(call.id);
    const w = call.drainWaiter;
    call.drainWaiter = undefined;
    w?.();
  }
}
