// src/h2 in a web page: a real node:http2 client's bytes (gRPC calls: unary, 1 MiB messages
// through 64 KiB windows, a stream, an error, a PING) are recorded against the sans-IO server, then
// played into a fresh server under Node and in headless Chromium (the module compiled by tsc to
// plain ES modules, loaded from a local HTTP server). Both must write the same bytes, whose answers
// are those the client got. Skipped where there is no Chromium (make system-deps installs it).

import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import http from "node:http";
import http2 from "node:http2";
import net from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { frameMessage } from "../src/h2/grpc.js";
import { HpackDecoder } from "../src/h2/hpack.js";
import { fromBase64, replay, replayServer, toBase64, transform } from "./h2replay.js";

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const CHROMIUM = ["/usr/bin/chromium", "/usr/bin/chromium-browser"].find((p) => existsSync(p));
const DEADLINE_MS = 60_000;

function within<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout;
  return Promise.race([
    p.finally(() => clearTimeout(timer)),
    new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what} took over ${ms} ms`)), ms);
    }),
  ]);
}

const sha = (b: Uint8Array): string => createHash("sha256").update(b).digest("hex");

/** Messages out of a gRPC body. */
function messages(body: Uint8Array): Uint8Array[] {
  const out: Uint8Array[] = [];
  const v = new DataView(body.buffer, body.byteOffset, body.byteLength);
  for (let at = 0; at < body.length; ) {
    const len = v.getUint32(at + 1);
    out.push(body.subarray(at + 5, at + 5 + len));
    at += 5 + len;
  }
  return out;
}

/** Record what a node:http2 client sends while it makes its calls; also the answers it got. */
async function record(): Promise<{ chunks: Uint8Array[]; answers: string[]; statuses: string[] }> {
  const chunks: Uint8Array[] = [];
  let closed!: () => void;
  const socketClosed = new Promise<void>((r) => (closed = r));
  const srv = net.createServer((sock) => {
    sock.setNoDelay(true);
    const conn = replayServer().connect({ write: (b) => void sock.write(b), close: () => sock.end() });
    sock.on("data", (c: Buffer) => {
      const copy = new Uint8Array(c);
      chunks.push(copy);
      conn.receive(copy);
    });
    sock.on("close", () => {
      conn.close();
      closed();
    });
    sock.on("error", () => undefined);
  });
  await within(new Promise<void>((r) => srv.listen(0, "127.0.0.1", r)), 5000, "listen");
  const port = (srv.address() as net.AddressInfo).port;
  const session = http2.connect(`http://127.0.0.1:${port}`, { createConnection: () => net.connect(port, "127.0.0.1") });
  session.on("error", () => undefined);
  const answers: string[] = [];
  const statuses: string[] = [];
  const call = (p: string, msgs: Uint8Array[]): Promise<void> =>
    within(
      new Promise<void>((resolve) => {
        const headers = { ":method": "POST", ":path": p, "content-type": "application/grpc", te: "trailers" };
        const req = session.request(headers);
        const body: Buffer[] = [];
        req.on("data", (c: Buffer) => body.push(c));
        req.on("trailers", (t) => statuses.push(`${t["grpc-status"]} ${t["grpc-message"] ?? ""}`.trim()));
        req.on("response", (h) => {
          if (h["grpc-status"] !== undefined) statuses.push(`${h["grpc-status"]} ${h["grpc-message"]}`);
        });
        req.on("error", () => undefined);
        req.on("close", () => {
          for (const m of messages(Buffer.concat(body))) answers.push(sha(m));
          resolve();
        });
        for (const m of msgs) req.write(frameMessage(m));
        req.end();
      }),
      DEADLINE_MS,
      `call ${p}`,
    );
  try {
    await call("/test.Echo/Unary", [new TextEncoder().encode("first")]);
    await Promise.all([
      ...Array.from({ length: 20 }, (_, i) => call("/test.Echo/Unary", [new Uint8Array(randomBytes(i * 997))])),
      call("/test.Echo/Unary", [new Uint8Array(randomBytes(1 << 20))]),
      call("/test.Echo/Unary", [new Uint8Array(randomBytes(1 << 20))]),
      call("/test.Echo/Bidi", Array.from({ length: 50 }, (_, i) => new Uint8Array(randomBytes(i * 313)))),
      call("/test.Echo/Fail", [new TextEncoder().encode("call 9")]),
    ]);
    await within(new Promise((r) => session.ping(Buffer.from("browser!"), r)), 5000, "PING");
  } finally {
    session.close();
    await within(socketClosed, 5000, "the connection's close");
    srv.close();
  }
  return { chunks, answers, statuses };
}

/** The answers in the server's bytes: message digests, and "status message" of each call. */
function answersIn(out: Uint8Array): { answers: string[]; statuses: string[] } {
  const dec = new HpackDecoder();
  const bodies = new Map<number, Uint8Array[]>();
  const statuses: string[] = [];
  const answers: string[] = [];
  let block: Uint8Array[] = [];
  for (let at = 0; at < out.length; ) {
    const len = (out[at]! << 16) | (out[at + 1]! << 8) | out[at + 2]!;
    const type = out[at + 3]!;
    const flags = out[at + 4]!;
    const id = new DataView(out.buffer, out.byteOffset + at + 5).getUint32(0) & 0x7fffffff;
    const payload = out.subarray(at + 9, at + 9 + len);
    at += 9 + len;
    if (type === 0) bodies.set(id, [...(bodies.get(id) ?? []), payload]);
    if (type === 1 || type === 9) {
      block.push(payload);
      if (flags & 0x4) {
        const headers = dec.decode(Buffer.concat(block));
        block = [];
        const st = headers.find(([n]) => n === "grpc-status");
        if (st) {
          const msg = headers.find(([n]) => n === "grpc-message")?.[1] ?? "";
          statuses.push(`${st[1]} ${msg}`.trim());
          for (const m of messages(Buffer.concat(bodies.get(id) ?? []))) answers.push(sha(m));
        }
      }
    }
  }
  return { answers, statuses };
}

test("src/h2 in headless Chromium writes the bytes it writes under Node", { skip: !CHROMIUM }, async () => {
  const rec = await record();
  assert.equal(rec.statuses.filter((s) => s === "0").length, 24);
  assert.equal(rec.answers.length, 1 + 20 + 2 + 50);
  // Under Node: the same calls, answered alike.
  const nodeOut = await replay(rec.chunks);
  assert.ok(nodeOut.length > 2 << 20, `${nodeOut.length} bytes`);
  const got = answersIn(nodeOut);
  assert.deepEqual([...got.answers].sort(), [...rec.answers].sort());
  assert.deepEqual([...got.statuses].sort(), [...rec.statuses].sort());
  assert.ok(rec.answers.includes(sha(transform(new TextEncoder().encode("first")))));

  // The module as a browser loads it: tsc's ES2022 output, no bundler, no Node shim.
  const dir = mkdtempSync(path.join(tmpdir(), "h2-browser-"));
  try {
    const tsc = spawnSync(process.execPath, [path.join(ROOT, "node_modules/typescript/bin/tsc"), "-p",
      path.join(ROOT, "tsconfig.h2.json"), "--noEmit", "false", "--outDir", path.join(dir, "js"), "--rootDir", ROOT],
    { encoding: "utf8", timeout: DEADLINE_MS });
    assert.equal(tsc.status, 0, tsc.stdout + tsc.stderr);
    const page = `<!doctype html><meta charset="utf-8"><title>h2</title><script type="module">
      import { replay, fromBase64, toBase64 } from "/js/test/h2replay.js";
      const send = (body) => fetch("/result", { method: "POST", body });
      try {
        const chunks = (await (await fetch("/transcript")).json()).map(fromBase64);
        const out = await replay(chunks);
        await send(JSON.stringify({ ok: true, out: toBase64(out), node: typeof process !== "undefined" }));
      } catch (e) {
        await send(JSON.stringify({ ok: false, error: String(e && e.stack || e) }));
      }
    </script>`;
    const transcript = JSON.stringify(rec.chunks.map(toBase64));
    type PageResult = { ok: boolean; out?: string; error?: string; node?: boolean };
    let resolveResult!: (r: PageResult) => void;
    const result = new Promise<PageResult>((r) => (resolveResult = r));
    const web = http.createServer((req, res) => {
      const url = req.url ?? "/";
      if (req.method === "POST" && url === "/result") {
        const body: Buffer[] = [];
        req.on("data", (c: Buffer) => body.push(c));
        req.on("end", () => {
          res.end("ok");
          resolveResult(JSON.parse(Buffer.concat(body).toString("utf8")));
        });
        return;
      }
      if (url === "/") return void res.writeHead(200, { "content-type": "text/html" }).end(page);
      if (url === "/transcript") return void res.writeHead(200, { "content-type": "application/json" }).end(transcript);
      const file = path.join(dir, path.normalize(url));
      if (url.startsWith("/js/") && file.startsWith(dir) && existsSync(file)) {
        return void res.writeHead(200, { "content-type": "text/javascript" }).end(readFileSync(file));
      }
      res.writeHead(404).end();
    });
    await within(new Promise<void>((r) => web.listen(0, "127.0.0.1", r)), 5000, "listen");
    const port = (web.address() as net.AddressInfo).port;
    const chrome = spawn(CHROMIUM!, ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
      "--disable-dev-shm-usage", `--user-data-dir=${path.join(dir, "profile")}`, `http://127.0.0.1:${port}/`],
    { stdio: ["ignore", "ignore", "pipe"] });
    let stderr = "";
    chrome.stderr.on("data", (c: Buffer) => (stderr = (stderr + c.toString()).slice(-4000)));
    try {
      const r = await within(result, DEADLINE_MS, `Chromium's answer (stderr: ${stderr})`);
      assert.ok(r.ok, r.error);
      assert.equal(r.node, false, "the page saw a Node global");
      const browserOut = fromBase64(r.out!);
      assert.equal(browserOut.length, nodeOut.length);
      assert.ok(Buffer.from(browserOut).equals(Buffer.from(nodeOut)), "Chromium and Node wrote different bytes");
    } finally {
      chrome.kill("SIGKILL");
      await within(new Promise((r) => (chrome.exitCode !== null ? r(null) : chrome.once("exit", r))), 10_000, "exit");
      await within(new Promise<void>((r) => web.close(() => r())), 5000, "close");
    }
  } finally {
    // Chromium's helpers may still write into its profile for a moment after it is killed.
    try {
      rmSync(dir, { recursive: true, force: true, maxRetries: 10, retryDelay: 200 });
    } catch {}
  }
});
