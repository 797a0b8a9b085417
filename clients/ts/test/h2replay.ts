// A recorded client's bytes played into a fresh sans-IO gRPC server (src/h2): the same code runs
// under Node and in headless Chromium (test/h2browser.test.ts), and both must write the same
// bytes. Browser-safe: no Node API (tsconfig.h2.json typechecks it with the browser's library).

import { GrpcError, GrpcServer, Status } from "../src/h2/grpc.js";

/** The echo service's transform: every byte XOR 0x5a. */
export function transform(b: Uint8Array): Uint8Array {
  const out = new Uint8Array(b.length);
  for (let i = 0; i < b.length; i++) out[i] = b[i]! ^ 0x5a;
  return out;
}

/** The service both runtimes serve. */
export function replayServer(): GrpcServer {
  const server = new GrpcServer({
    maxReceiveMessageBytes: 8 << 20,
    maxSendMessageBytes: 8 << 20,
    h2: { initialWindowSize: 65535, connectionWindowSize: 256 << 10 },
  });
  server.unary("/test.Echo/Unary", (req) => transform(req));
  server.unary("/test.Echo/Fail", (req) => {
    throw new GrpcError(Status.FAILED_PRECONDITION, `refused: ${new TextDecoder().decode(req)} — ünïcode 100%`);
  });
  server.stream("/test.Echo/Bidi", async function* (requests) {
    for await (const r of requests) yield transform(r);
  });
  return server;
}

/** One macrotask later: every promise chain the last chunk started (the handlers wait on nothing
 * else) has run. A MessageChannel, not setTimeout, whose browsers clamp to 4 ms. */
function turn(): Promise<void> {
  return new Promise((resolve) => {
    const ch = new MessageChannel();
    // onmessage: the browser's MessagePort and Node's both have it (@types/node does not say so).
    (ch.port1 as unknown as { onmessage: (() => void) | null }).onmessage = () => {
      ch.port1.close();
      ch.port2.close();
      resolve();
    };
    ch.port2.postMessage(0);
  });
}

/** Feed `chunks` one at a time (letting the handlers run between them); the bytes written. */
export async function replay(chunks: readonly Uint8Array[]): Promise<Uint8Array> {
  const out: Uint8Array[] = [];
  const conn = replayServer().connect({ write: (b) => void out.push(b.slice()), close: () => undefined });
  for (const c of chunks) {
    conn.receive(c.slice());
    await turn();
  }
  await turn();
  conn.close();
  const total = out.reduce((a, b) => a + b.length, 0);
  const all = new Uint8Array(total);
  let at = 0;
  for (const b of out) {
    all.set(b, at);
    at += b.length;
  }
  return all;
}

export function toBase64(b: Uint8Array): string {
  let s = "";
  for (let i = 0; i < b.length; i += 0x8000) s += String.fromCharCode(...b.subarray(i, i + 0x8000));
  return btoa(s);
}

export function fromBase64(s: string): Uint8Array {
  const bin = atob(s);
  const b = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) b[i] = bin.charCodeAt(i);
  return b;
}
