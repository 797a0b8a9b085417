// The sans-IO HTTP/2 + gRPC server (src/h2) against a real client: node:http2's, over a TCP
// connection on 127.0.0.1, making gRPC calls (unary and streaming, many at once, 4 MiB messages
// through flow-control windows far smaller) whose answers are checked byte for byte; and the
// same load against node:http2's own server, for a comparison of throughput.

import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import http2 from "node:http2";
import net from "node:net";
import { after, before, describe, test } from "node:test";

import { GrpcError, GrpcServer, Status, frameMessage, percentDecode } from "../src/h2/grpc.js";

const DEADLINE_MS = 30_000;

/** Resolve with `p`, or fail after `ms` (every wait in these tests has a deadline). */
function within<T>(p: Promise<T>, ms = DEADLINE_MS, what = "a wait"): Promise<T> {
  let timer: NodeJS.Timeout;
  return Promise.race([
    p.finally(() => clearTimeout(timer)),
    new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what} took over ${ms} ms`)), ms);
    }),
  ]);
}

/** The echo service's transform: every byte XOR 0x5a, so an answer is not its request. */
function transform(b: Uint8Array): Uint8Array {
  const out = new Uint8Array(b.length);
  for (let i = 0; i < b.length; i++) out[i] = b[i]! ^ 0x5a;
  return out;
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

interface Served {
  port: number;
  close(): Promise<void>;
  /** Connections accepted so far. */
  connections: number;
  /** Bytes received from clients so far. */
  bytesIn: number;
}

/** A TCP listener on 127.0.0.1 whose every connection is served by `server` (sans-IO). */
async function listenSansIo(server: GrpcServer): Promise<Served> {
  const sockets = new Set<net.Socket>();
  const served = { port: 0, connections: 0, bytesIn: 0, close: async () => undefined } as Served;
  const srv = net.createServer((sock) => {
    served.connections += 1;
    sockets.add(sock);
    sock.setNoDelay(true);
    const conn = server.connect({ write: (b) => void sock.write(b), close: () => sock.end() });
    sock.on("data", (chunk: Buffer) => {
      served.bytesIn += chunk.length;
      conn.receive(new Uint8Array(chunk));
    });
    sock.on("close", () => {
      sockets.delete(sock);
      conn.close();
    });
    sock.on("error", () => undefined);
  });
  await within(new Promise<void>((r) => srv.listen(0, "127.0.0.1", r)), 5000, "listen");
  served.port = (srv.address() as net.AddressInfo).port;
  served.close = () => {
    for (const s of sockets) s.destroy();
    return within(new Promise<void>((r) => srv.close(() => r())), 5000, "close");
  };
  return served;
}

/** The same echo service on node:http2's server, gRPC framing by hand (unary only). */
async function listenNode(): Promise<Served> {
  const srv = http2.createServer({ settings: { initialWindowSize: 1 << 20 } });
  srv.on("session", (s) => s.setLocalWindowSize(16 << 20));
  srv.on("stream", (stream) => {
    const chunks: Buffer[] = [];
    stream.on("data", (c: Buffer) => chunks.push(c));
    stream.on("end", () => {
      const body = Buffer.concat(chunks);
      stream.respond({ ":status": 200, "content-type": "application/grpc" }, { waitForTrailers: true });
      stream.on("wantTrailers", () => stream.sendTrailers({ "grpc-status": "0" }));
      stream.end(frameMessage(transform(body.subarray(5))));
    });
    stream.on("error", () => undefined);
  });
  await within(new Promise<void>((r) => srv.listen(0, "127.0.0.1", r)), 5000, "listen");
  return {
    port: (srv.address() as net.AddressInfo).port,
    connections: 0,
    bytesIn: 0,
    close: () => within(new Promise<void>((r) => srv.close(() => r())), 5000, "close"),
  };
}

/** A node:http2 client whose connection is a TCP socket to `port` (createConnection). */
function dial(port: number, settings: http2.Settings = {}): http2.ClientHttp2Session {
  const session = http2.connect(`http://127.0.0.1:${port}`, {
    createConnection: () => net.connect(port, "127.0.0.1"),
    settings,
  });
  session.on("error", () => undefined);
  return session;
}

interface Answer {
  httpStatus: number;
  status: number | undefined;
  message: string;
  messages: Uint8Array[];
  headers: http2.IncomingHttpHeaders;
  trailers: http2.IncomingHttpHeaders;
  rstCode: number;
}

/** Parse length-prefixed messages out of a response body. */
function parseMessages(body: Buffer): Uint8Array[] {
  const out: Uint8Array[] = [];
  let at = 0;
  while (at < body.length) {
    assert.ok(at + 5 <= body.length, "a truncated message prefix");
    assert.equal(body[at], 0, "a compressed response");
    const len = body.readUInt32BE(at + 1);
    assert.ok(at + 5 + len <= body.length, "a truncated message");
    out.push(new Uint8Array(body.subarray(at + 5, at + 5 + len)));
    at += 5 + len;
  }
  return out;
}

interface CallOptions {
  headers?: http2.OutgoingHttpHeaders;
  /** Raw body instead of framed messages. */
  raw?: Uint8Array;
  /** Called with the request stream once it is open (to cancel it, or to send more). */
  onStream?: (req: http2.ClientHttp2Stream) => void;
  /** Leave the request open (onStream ends it). */
  open?: boolean;
}

function call(
  session: http2.ClientHttp2Session,
  path: string,
  messages: Uint8Array[],
  o: CallOptions = {},
): Promise<Answer> {
  const req = session.request({
    ":method": "POST",
    ":path": path,
    "content-type": "application/grpc",
    te: "trailers",
    ...o.headers,
  });
  const p = new Promise<Answer>((resolve, reject) => {
    const chunks: Buffer[] = [];
    let headers: http2.IncomingHttpHeaders = {};
    let trailers: http2.IncomingHttpHeaders = {};
    req.on("response", (h) => (headers = h));
    req.on("trailers", (t) => (trailers = t));
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("error", () => undefined);
    req.on("close", () => {
      try {
        const end = Object.keys(trailers).length ? trailers : headers;
        const status = end["grpc-status"];
        resolve({
          httpStatus: Number(headers[":status"]),
          status: status === undefined ? undefined : Number(status),
          message: percentDecode(String(end["grpc-message"] ?? "")),
          messages: parseMessages(Buffer.concat(chunks)),
          headers,
          trailers,
          rstCode: req.rstCode ?? 0,
        });
      } catch (exc) {
        reject(exc);
      }
    });
  });
  if (o.raw) req.write(o.raw);
  for (const m of messages) req.write(frameMessage(m));
  if (!o.open) req.end();
  o.onStream?.(req);
  return within(p, DEADLINE_MS, `call ${path}`);
}

// -- the service under test ---------------------------------------------------------------------

let cancelledSeen = 0;
/** Opens the gate of /test.Echo/Lazy, whose handler reads nothing before. */
let openGate: () => void = () => undefined;
let cancelWaiters: (() => void)[] = [];

/** Small windows by default: 4 MiB messages cross them many times over. */
function echoServer(h2 = { initialWindowSize: 65535, connectionWindowSize: 256 << 10, maxConcurrentStreams: 200 }) {
  const server = new GrpcServer({ maxReceiveMessageBytes: 8 << 20, maxSendMessageBytes: 8 << 20, h2 });
  server.unary("/test.Echo/Unary", (req) => transform(req));
  server.unary("/test.Echo/Slow", async (req, ctx) => {
    await new Promise<void>((resolve) => {
      const t = setTimeout(resolve, 10_000);
      ctx.signal.addEventListener("abort", () => {
        clearTimeout(t);
        cancelledSeen += 1;
        for (const w of cancelWaiters.splice(0)) w();
        resolve();
      });
    });
    return req;
  });
  server.unary("/test.Echo/Fail", (req) => {
    throw new GrpcError(Status.FAILED_PRECONDITION, `refused: ${new TextDecoder().decode(req)} — ünïcode 100%`);
  });
  server.unary("/test.Echo/Big", (req) => new Uint8Array(new DataView(req.buffer, req.byteOffset).getUint32(0)));
  server.stream("/test.Echo/Bidi", async function* (requests) {
    for await (const r of requests) yield transform(r);
  });
  server.stream("/test.Echo/Lazy", async function* (requests) {
    await new Promise<void>((r) => (openGate = r));
    let bytes = 0;
    for await (const r of requests) bytes += r.length;
    yield new TextEncoder().encode(String(bytes));
  });
  server.stream("/test.Echo/Count", async function* (requests) {
    let n = 0;
    let bytes = 0;
    for await (const r of requests) {
      n += 1;
      bytes += r.length;
    }
    yield new TextEncoder().encode(`${n} ${bytes}`);
  });
  return server;
}

describe("gRPC over the sans-IO HTTP/2 server, with node:http2 as the client", () => {
  let served: Served;
  let session: http2.ClientHttp2Session;

  before(async () => {
    served = await listenSansIo(echoServer());
    session = dial(served.port);
  });

  after(async () => {
    session.destroy();
    await served.close();
  });

  test("one unary call: headers, the message, trailers", async () => {
    const msg = new TextEncoder().encode("hello");
    const a = await call(session, "/test.Echo/Unary", [msg]);
    assert.equal(a.httpStatus, 200);
    assert.equal(a.headers["content-type"], "application/grpc");
    assert.equal(a.status, Status.OK);
    assert.deepEqual(a.messages, [transform(msg)]);
  });

  test("150 concurrent unary calls of random sizes, every answer byte for byte", async () => {
    const reqs = Array.from({ length: 150 }, (_, i) => new Uint8Array(randomBytes((i * 7919) % 70_000)));
    const answers = await Promise.all(reqs.map((r) => call(session, "/test.Echo/Unary", [r])));
    answers.forEach((a, i) => {
      assert.equal(a.status, Status.OK, a.message);
      assert.equal(a.messages.length, 1);
      assert.ok(Buffer.from(a.messages[0]!).equals(Buffer.from(transform(reqs[i]!))), `call ${i}`);
    });
  });

  test("8 concurrent 4 MiB calls cross windows of 64 KiB (streams) and 256 KiB (connection)", async () => {
    const reqs = Array.from({ length: 8 }, () => new Uint8Array(randomBytes(4 << 20)));
    const answers = await Promise.all(reqs.map((r) => call(session, "/test.Echo/Unary", [r])));
    answers.forEach((a, i) => {
      assert.equal(a.status, Status.OK, a.message);
      assert.ok(Buffer.from(a.messages[0]!).equals(Buffer.from(transform(reqs[i]!))), `call ${i}`);
    });
  });

  test("a bidirectional stream: 200 messages, answered in order", async () => {
    const reqs = Array.from({ length: 200 }, (_, i) => new Uint8Array(randomBytes(1 + ((i * 997) % 50_000))));
    const a = await call(session, "/test.Echo/Bidi", reqs);
    assert.equal(a.status, Status.OK, a.message);
    assert.equal(a.messages.length, reqs.length);
    a.messages.forEach((m, i) => assert.ok(Buffer.from(m).equals(Buffer.from(transform(reqs[i]!))), `message ${i}`));
  });

  test("a client-streaming count, the request half-closed last", async () => {
    const reqs = [new Uint8Array(10), new Uint8Array(0), new Uint8Array(3 << 20)];
    const a = await call(session, "/test.Echo/Count", reqs);
    assert.equal(a.status, Status.OK, a.message);
    assert.equal(new TextDecoder().decode(a.messages[0]), `3 ${10 + (3 << 20)}`);
  });

  test("backpressure: a handler that does not read stops the client at the high-water mark", async () => {
    const before = served.bytesIn;
    const reqs = Array.from({ length: 64 }, () => new Uint8Array(65536));
    const a = call(session, "/test.Echo/Lazy", reqs);
    const t0 = Date.now();
    while (served.bytesIn - before <= 1 << 20 && Date.now() - t0 < DEADLINE_MS) await sleep(20);
    await sleep(300); // and no further
    const held = served.bytesIn - before;
    // 1 MiB waiting for the handler, plus a stream window of 64 KiB at most (and frame headers).
    assert.ok(held > 1 << 20 && held < (1 << 20) + 2 * 65536 + 8192, `${held} bytes arrived`);
    openGate();
    const answer = await a;
    assert.equal(answer.status, Status.OK, answer.message);
    assert.equal(new TextDecoder().decode(answer.messages[0]), String(64 * 65536));
  });

  test("a handler's error: its code, and its message percent-encoded in the trailers", async () => {
    const a = await call(session, "/test.Echo/Fail", [new TextEncoder().encode("call 7")]);
    assert.equal(a.status, Status.FAILED_PRECONDITION);
    assert.equal(a.message, "refused: call 7 — ünïcode 100%");
    assert.match(String(a.headers["grpc-message"] ?? a.trailers["grpc-message"]), /^refused: call 7 %E2%80%94 /);
    assert.deepEqual(a.messages, []);
  });

  test("an unknown method: UNIMPLEMENTED", async () => {
    const a = await call(session, "/test.Echo/Nope", [new Uint8Array(1)]);
    assert.equal(a.httpStatus, 200);
    assert.equal(a.status, Status.UNIMPLEMENTED);
    assert.match(a.message, /unknown method \/test\.Echo\/Nope/);
  });

  test("a request over the size limit: RESOURCE_EXHAUSTED, before the rest of it arrives", async () => {
    const a = await call(session, "/test.Echo/Unary", [new Uint8Array((8 << 20) + 1)]);
    assert.equal(a.status, Status.RESOURCE_EXHAUSTED);
    assert.match(a.message, /larger than max \(8388609 vs\. 8388608\)/);
  });

  test("a response over the size limit: RESOURCE_EXHAUSTED", async () => {
    const want = new Uint8Array(4);
    new DataView(want.buffer).setUint32(0, (8 << 20) + 1);
    const a = await call(session, "/test.Echo/Big", [want]);
    assert.equal(a.status, Status.RESOURCE_EXHAUSTED);
  });

  test("compressed messages: INTERNAL for the flag, UNIMPLEMENTED for grpc-encoding", async () => {
    const flagged = frameMessage(new Uint8Array(3));
    flagged[0] = 1;
    const a = await call(session, "/test.Echo/Unary", [], { raw: flagged });
    assert.equal(a.status, Status.INTERNAL);
    const b = await call(session, "/test.Echo/Unary", [new Uint8Array(3)], { headers: { "grpc-encoding": "gzip" } });
    assert.equal(b.status, Status.UNIMPLEMENTED);
    assert.equal(b.headers["grpc-accept-encoding"], "identity");
  });

  test("not gRPC: HTTP 415", async () => {
    const headers = { "content-type": "text/plain" };
    const a = await call(session, "/test.Echo/Unary", [new Uint8Array(1)], { headers });
    assert.equal(a.httpStatus, 415);
  });

  test("grpc-timeout: DEADLINE_EXCEEDED, the handler's signal aborted; a malformed one: INTERNAL", async () => {
    const seen = cancelledSeen;
    const t0 = Date.now();
    const a = await call(session, "/test.Echo/Slow", [new Uint8Array(1)], { headers: { "grpc-timeout": "200m" } });
    assert.equal(a.status, Status.DEADLINE_EXCEEDED);
    assert.ok(Date.now() - t0 < 5000);
    assert.equal(cancelledSeen, seen + 1);
    const b = await call(session, "/test.Echo/Slow", [new Uint8Array(1)], { headers: { "grpc-timeout": "1x" } });
    assert.equal(b.status, Status.INTERNAL);
  });

  test("the client cancels (RST_STREAM CANCEL): the handler's signal aborts, the connection lives on", async () => {
    const seen = cancelledSeen;
    const aborted = new Promise<void>((r) => cancelWaiters.push(r));
    const a = call(session, "/test.Echo/Slow", [new Uint8Array(1)], {
      onStream: (req) => setTimeout(() => req.close(http2.constants.NGHTTP2_CANCEL), 100),
    });
    await within(aborted, 5000, "the handler's abort");
    assert.equal(cancelledSeen, seen + 1);
    assert.equal((await a).status, undefined);
    const b = await call(session, "/test.Echo/Unary", [new Uint8Array(2)]);
    assert.equal(b.status, Status.OK);
  });

  test("a client that does not speak HTTP/2: GOAWAY PROTOCOL_ERROR, then the connection closes", async () => {
    const sock = net.connect(served.port, "127.0.0.1");
    const got: Buffer[] = [];
    sock.on("data", (c: Buffer) => got.push(c));
    sock.on("error", () => undefined);
    sock.write("GET / HTTP/1.1\r\nhost: x\r\n\r\n");
    await within(new Promise((r) => sock.on("close", r)), 5000, "the server's close");
    const bytes = Buffer.concat(got);
    const types: number[] = [];
    let goaway = -1;
    for (let at = 0; at < bytes.length; ) {
      const len = bytes.readUIntBE(at, 3);
      types.push(bytes[at + 3]!);
      if (bytes[at + 3] === 7) goaway = bytes.readUInt32BE(at + 9 + 4);
      at += 9 + len;
    }
    assert.deepEqual(types, [4, 8, 7]); // SETTINGS, WINDOW_UPDATE, GOAWAY
    assert.equal(goaway, 1); // PROTOCOL_ERROR
  });

  test("a PING is answered", async () => {
    const rtt = await within(
      new Promise<number>((resolve, reject) =>
        session.ping(Buffer.from("kvasir!!"), (err, ms, payload) => {
          if (err) reject(err);
          else {
            assert.equal(payload.toString(), "kvasir!!");
            resolve(ms);
          }
        }),
      ),
      5000,
      "PING",
    );
    assert.ok(rtt >= 0);
  });

  test("a client with a 16 KiB stream window and a peer frame size of 1 MiB", async () => {
    const s2 = dial(served.port, { initialWindowSize: 16384, maxFrameSize: 1 << 20 });
    try {
      const req = new Uint8Array(randomBytes(2 << 20));
      const a = await call(s2, "/test.Echo/Unary", [req]);
      assert.equal(a.status, Status.OK, a.message);
      assert.ok(Buffer.from(a.messages[0]!).equals(Buffer.from(transform(req))));
    } finally {
      s2.destroy();
    }
  });
});

describe("throughput against node:http2's server", () => {
  test("32 calls of 1 MiB, 8 at a time, on each server", async (t) => {
    const rates: Record<string, { mbps: number; callsPerS: number }> = {};
    // The windows node:http2's server is given: 1 MiB per stream, 16 MiB for the connection.
    const sans = await listenSansIo(echoServer({ initialWindowSize: 1 << 20, connectionWindowSize: 16 << 20,
      maxConcurrentStreams: 100 }));
    const node = await listenNode();
    try {
      for (const [name, srv] of [["sans-io", sans], ["node:http2", node]] as const) {
        const s = dial(srv.port, { initialWindowSize: 1 << 20 });
        await within(new Promise((r) => s.once("connect", r)), 5000, "connect");
        s.setLocalWindowSize(16 << 20);
        try {
          const req = new Uint8Array(randomBytes(1 << 20));
          await call(s, "/test.Echo/Unary", [req]); // warm up
          const t0 = performance.now();
          for (let round = 0; round < 4; round++) {
            const answers = await Promise.all(Array.from({ length: 8 }, () => call(s, "/test.Echo/Unary", [req])));
            for (const a of answers) assert.equal(a.messages[0]!.length, req.length);
          }
          const secs = (performance.now() - t0) / 1000;
          rates[name] = { mbps: (32 * 2 * (1 << 20)) / secs / 1e6, callsPerS: 32 / secs };
        } finally {
          s.destroy();
        }
      }
      // Small calls: calls per second.
      for (const [name, srv] of [["sans-io", sans], ["node:http2", node]] as const) {
        const s = dial(srv.port);
        try {
          const req = new Uint8Array(100);
          const t0 = performance.now();
          for (let round = 0; round < 10; round++) {
            await Promise.all(Array.from({ length: 50 }, () => call(s, "/test.Echo/Unary", [req])));
          }
          rates[name]!.callsPerS = 500 / ((performance.now() - t0) / 1000);
        } finally {
          s.destroy();
        }
      }
    } finally {
      await sans.close();
      await node.close();
    }
    const line = Object.entries(rates)
      .map(([n, r]) => `${n}: ${r.mbps.toFixed(0)} MB/s (1 MiB echo), ${r.callsPerS.toFixed(0)} calls/s (100 B)`)
      .join("; ");
    t.diagnostic(line);
    console.log(`# throughput: ${line}`);
  });
});

