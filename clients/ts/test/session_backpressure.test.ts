// Send backpressure in the session core (src/worker/session_core.ts): a WebSocket's send never
// blocks, so replies the hub has not read yet queue in its bufferedAmount. Over
// SEND_HIGH_WATER_BYTES the core hands no received tunnel data to the local server (no new call
// starts), resumes under SEND_LOW_WATER_BYTES, and closes the session 1001 when the queue has
// not drained SEND_STALL_TIMEOUT_MS after passing the mark.
//
// Everything is real but the socket: the worker's handshake (tests/vectors/handshake.json), the
// sealed channel (ChaCha20-Poly1305, the hub's side derived from the vectors' keys), tunnel
// control, the sans-IO HTTP/2 + gRPC server (src/h2) behind the tunnel, and node:http2 as the
// hub's client making gRPC calls through it. The socket is a fake whose bufferedAmount the test
// sets, and the core's timers run on a clock the test advances (the real 30 s deadline, at once).

import assert from "node:assert/strict";
import http2 from "node:http2";
import { Duplex } from "node:stream";
import { test } from "node:test";

import { frameMessage, GrpcServer } from "../src/h2/grpc.js";
import { CloseCode, fromHex } from "../src/worker/bytes.js";
import { deriveTunnelKeys, KeyExchange, TunnelCipher } from "../src/worker/channel.js";
import { parseAccept, transcriptHash } from "../src/worker/handshake.js";
import {
  type Clock,
  SansIoConnection,
  SEND_DRAIN_POLL_MS,
  SEND_HIGH_WATER_BYTES,
  SEND_LOW_WATER_BYTES,
  SEND_STALL_TIMEOUT_MS,
  SessionCore,
  type SessionTransport,
  TUNNEL_SUBPROTOCOL,
} from "../src/worker/session_core.js";
import { vectorHandshake, vectors } from "./vectors.js";

const DEADLINE_MS = 20_000;

/** Resolve with `p`, or fail after `ms` (every wait in these tests has a deadline). */
function within<T>(p: Promise<T>, what: string, ms = DEADLINE_MS): Promise<T> {
  let timer: NodeJS.Timeout;
  return Promise.race([
    p.finally(() => clearTimeout(timer)),
    new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what}: not within ${ms} ms`)), ms);
    }),
  ]);
}

/** Wait (real time, bounded) until `cond` holds. */
async function until(cond: () => boolean, what: string, ms = DEADLINE_MS): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`${what}: not within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

/** The core's timers, fired only when the test advances the clock. */
class ManualClock implements Clock {
  now = 0;
  private seq = 0;
  private readonly timers = new Map<number, { due: number; fn: () => void }>();

  set(fn: () => void, ms: number): unknown {
    this.seq += 1;
    this.timers.set(this.seq, { due: this.now + ms, fn });
    return this.seq;
  }

  clear(t: unknown): void {
    this.timers.delete(t as number);
  }

  /** Fire, in order, every timer due within `ms` (those set meanwhile too). */
  advance(ms: number): void {
    const end = this.now + ms;
    for (;;) {
      let next: [number, { due: number; fn: () => void }] | undefined;
      for (const e of this.timers) if (e[1].due <= end && (!next || e[1].due < next[1].due)) next = e;
      if (!next) break;
      this.timers.delete(next[0]);
      this.now = next[1].due;
      next[1].fn();
    }
    this.now = end;
  }
}

/** The socket: what the core sends goes to the hub's side; `queued` is its bufferedAmount. */
class FakeSocket implements SessionTransport {
  queued = 0;
  closed: { code: number; reason: string } | undefined;
  constructor(
    private readonly core: () => SessionCore,
    private readonly deliver: (m: Uint8Array | string) => void,
  ) {}

  readonly bufferedAmount = (): number => this.queued;

  send(msg: Uint8Array | string, sent?: () => void): void {
    this.deliver(msg);
    sent?.();
  }

  close(code: number, reason: string): void {
    this.closed = { code, reason };
    // The close handshake completes: the socket's close event.
    queueMicrotask(() => {
      const core = this.core();
      core.finish({ established: core.isEstablished, code, reason, local: true, fatal: false });
    });
  }

  abort(): void {}
}

interface Answer {
  status: number | undefined;
  body: Buffer;
}

/** A unary gRPC call on `client` (gRPC framing by hand). */
function call(client: http2.ClientHttp2Session, path: string, message: Uint8Array): Promise<Answer> {
  const req = client.request({ ":method": "POST", ":path": path, "content-type": "application/grpc", te: "trailers" });
  const chunks: Buffer[] = [];
  let status: number | undefined;
  req.on("response", (h) => {
    if (h["grpc-status"] !== undefined) status = Number(h["grpc-status"]);
  });
  req.on("trailers", (t) => (status = Number(t["grpc-status"])));
  req.on("data", (c: Buffer) => chunks.push(c));
  req.on("error", () => undefined);
  const done = new Promise<Answer>((resolve) => req.on("close", () => resolve({ status, body: Buffer.concat(chunks) })));
  req.end(frameMessage(message));
  return done;
}

test("send backpressure: calls wait over the high-water mark, go on under the low one, and the session closes past the deadline", async () => {
  const h = vectors("handshake");
  const clock = new ManualClock();
  const log: string[] = [];

  // The service behind the tunnel: every call it starts is counted.
  let dispatched = 0;
  const grpc = new GrpcServer();
  grpc.unary("/test.Echo/Unary", (req) => {
    dispatched += 1;
    return req;
  });

  // The hub's side of the wire: its cipher (once live), the HTTP/2 client's bytes.
  let hub: TunnelCipher | undefined;
  const controls: string[] = [];
  let heartbeats = 0;
  const wire = new Duplex({
    read() {},
    write(chunk: Buffer, _enc, cb) {
      core.receive(hub!.sealData(new Uint8Array(chunk)));
      cb();
    },
  });
  const toHub: (Uint8Array | string)[] = [];
  const fromWorker = (m: Uint8Array | string): void => {
    if (!hub) {
      toHub.push(m); // the handshake's hello
      return;
    }
    const opened = hub.open(m);
    if (opened.kind === "data") wire.push(Buffer.from(opened.data));
    else if (opened.kind === "control") controls.push(opened.word);
    else if (opened.kind === "heartbeat") {
      heartbeats += 1;
      core.receive(hub.sealHeartbeat(opened.seq, true));
    }
  };

  const core: SessionCore = new SessionCore({
    log: (line) => log.push(line),
    connect: (c) => new SansIoConnection(c, grpc),
    clock,
  });
  const socket = new FakeSocket(() => core, fromWorker);
  const hs = vectorHandshake(h);

  // The handshake of the vectors, sealed end to end.
  core.attach(socket, hs);
  core.opened(TUNNEL_SUBPROTOCOL);
  const challenge = fromHex(h.session_challenge_hex);
  core.receive(challenge);
  await until(() => toHub.length === 1, "the hello");
  const accept = fromHex(h.session_accept_hex);
  const { aead } = parseAccept(accept);
  const shared = new KeyExchange(fromHex(h.hub_kx_private_hex)).sharedSecret(fromHex(h.worker_kx_public_hex));
  hub = TunnelCipher.forHub(deriveTunnelKeys(shared, transcriptHash(challenge, toHub[0] as Uint8Array), aead), aead);
  core.receive(accept);
  await until(() => core.live, "the session live");
  assert.equal(core.encrypted, true);

  // The hub opens the tunnel's connection and makes calls through it.
  core.receive(hub.sealControl("open"));
  const client = http2.connect("http://worker.tunnel", { createConnection: () => wire });
  client.on("error", () => undefined);
  try {
    const a = await within(call(client, "/test.Echo/Unary", new Uint8Array([1, 2, 3])), "call A");
    assert.equal(a.status, 0);
    assert.equal(dispatched, 1);
    assert.equal(core.backpressured, false);

    // Over the high-water mark: call B's request is held, not handed to the service.
    socket.queued = SEND_HIGH_WATER_BYTES + 1;
    let bDone = false;
    const b = call(client, "/test.Echo/Unary", new Uint8Array([4, 5]));
    void b.then(() => (bDone = true));
    await until(() => core.heldBytes > 0, "call B held");
    assert.equal(core.backpressured, true);
    assert.ok(log.some((l) => l.includes("taking no new calls")), log.join("\n"));
    // Drained to between the marks: still held (the low-water mark resumes), no heartbeat sent.
    socket.queued = SEND_LOW_WATER_BYTES + 1;
    clock.advance(20_000);
    await new Promise((r) => setImmediate(r));
    assert.equal(dispatched, 1);
    assert.equal(bDone, false);
    assert.equal(core.backpressured, true);
    assert.equal(heartbeats, 0, "a heartbeat sent behind a full queue");
    assert.equal(socket.closed, undefined);

    // Under the low-water mark: the next poll delivers what was held; call B is answered.
    socket.queued = SEND_LOW_WATER_BYTES;
    clock.advance(SEND_DRAIN_POLL_MS);
    assert.equal(core.backpressured, false);
    assert.equal(core.heldBytes, 0);
    const bAnswer = await within(b, "call B after the drain");
    assert.equal(bAnswer.status, 0);
    assert.equal(dispatched, 2);
    assert.ok(log.some((l) => l.includes("taking calls again")), log.join("\n"));
    // Keepalive goes on once drained: a heartbeat, answered.
    clock.advance(15_000);
    await until(() => heartbeats === 1, "a heartbeat after the drain");

    // Over the mark for good: call C waits, and the session closes 1001 at the deadline.
    socket.queued = SEND_HIGH_WATER_BYTES + 1;
    const c = call(client, "/test.Echo/Unary", new Uint8Array([6]));
    await until(() => core.heldBytes > 0, "call C held");
    clock.advance(SEND_STALL_TIMEOUT_MS - SEND_DRAIN_POLL_MS);
    assert.equal(socket.closed, undefined, "closed before the deadline");
    clock.advance(SEND_DRAIN_POLL_MS);
    const closed = socket.closed as { code: number; reason: string } | undefined; // set by the advance
    assert.ok(closed, "not closed at the deadline");
    assert.equal(closed.code, CloseCode.GOING_AWAY);
    assert.match(closed.reason, /^send queue not drained: 8\.0 MiB unsent 30 s after passing 8\.0 MiB/);
    assert.ok(new TextEncoder().encode(`1001 ${closed.reason}`).byteLength <= 120, closed.reason);
    const end = await within(core.done, "the session's end");
    assert.equal(end.code, CloseCode.GOING_AWAY);
    assert.equal(end.established, true);
    assert.equal(end.local, true);
    assert.equal(end.fatal, false);
    assert.equal(dispatched, 2, "call C reached the service");
    assert.equal(core.heldBytes, 0);
    client.destroy();
    wire.destroy();
    await within(c, "call C ended with the connection");
  } finally {
    client.destroy();
    wire.destroy();
  }
});
