// The WASM kernel in a web page: src/wasm/kernel.ts bundled for the browser (esbuild,
// platform "browser": a Node built-in would fail the bundle), served over HTTP with kernel.wasm
// beside it, loaded by headless Chromium with `WasmKernel.load()` (fetch and
// instantiateStreaming), and its results posted back. They must equal the same module's results
// under Node: one WebAssembly binary, whose float32 arithmetic is deterministic (IEEE 754, round
// to nearest; only NaN payloads may differ, and no NaN arises here), in any engine.
// Skipped without Chromium (`make system-deps` installs it).
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { delimiter, join } from "node:path";
import { test } from "node:test";

import { build } from "esbuild";

import { rounder, type FloatDType } from "../src/worker/dtype.js";
import { defaultFunction, matricesFromStored, type ExpertFunction } from "../src/worker/expert.js";
import { WasmKernel } from "../src/wasm/kernel.js";

const ROOT = join(import.meta.dirname, "..");
const WASM = join(ROOT, "src", "wasm", "kernel.wasm");

function chromium(): string | undefined {
  for (const dir of (process.env.PATH ?? "").split(delimiter)) {
    for (const name of ["chromium", "chromium-browser"]) if (existsSync(join(dir, name))) return join(dir, name);
  }
  return existsSync("/usr/bin/chromium") ? "/usr/bin/chromium" : undefined;
}

// The page: fetch the cases, compute each with the kernel fetched beside the bundle, post the results.
const PAGE_SCRIPT = `
import { WasmKernel } from "./kernel.ts";
const post = (body) => fetch("./results", { method: "POST", body: JSON.stringify(body) });
try {
  const { cases } = await (await fetch("./cases.json")).json();
  const kernel = await WasmKernel.load();
  const f32 = (a) => Float32Array.from(a);
  const results = cases.map((c) => {
    const m = { H: c.H, I: c.I, GU: f32(c.GU), D: f32(c.D) };
    if (c.biasGU) Object.assign(m, { biasGU: f32(c.biasGU), biasD: f32(c.biasD) });
    const r = kernel.expertForward(c.fn, c.dtype, m, f32(c.rows), c.weights, c.dtype);
    return { out: Array.from(r.out), proj: Array.from(r.proj) };
  });
  await post({ ok: true, results });
} catch (exc) {
  await post({ ok: false, error: String(exc && exc.stack || exc) });
}
`;

interface PageCase {
  fn: ExpertFunction;
  dtype: FloatDType;
  H: number;
  I: number;
  GU: number[];
  D: number[];
  biasGU?: number[];
  biasD?: number[];
  rows: number[];
  weights: number[];
}

function pageCases(): PageCase[] {
  let seed = 12345;
  const rand = (): number => {
    seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
    return seed / 2 ** 32;
  };
  const vals = (len: number, scale: number, dtype: FloatDType): number[] =>
    Array.from({ length: len }, () => rounder(dtype)((2 * rand() - 1) * scale));
  const gptOss: ExpertFunction = {
    gate: "clamped_swiglu", activation: "", alpha: 1.702, limit: 7, interleaved: true, transposed: true, bias: true,
  };
  const specs: [ExpertFunction, FloatDType, number, number, number][] = [
    [defaultFunction("silu"), "float32", 37, 11, 17],
    [defaultFunction("gelu"), "bfloat16", 64, 24, 5],
    [{ ...defaultFunction("silu"), gate: "clamped_glu", limit: 7 }, "float16", 13, 5, 3],
    [gptOss, "bfloat16", 40, 9, 1],
  ];
  return specs.map(([fn, dtype, H, I, n]) => {
    const f32 = (len: number, scale: number): Float32Array => Float32Array.from(vals(len, scale, dtype));
    const gateUp = f32(2 * I * H, Math.sqrt(3 / H));
    const down = f32(H * I, Math.sqrt(3 / I));
    const biases = fn.bias ? { gateUp: f32(2 * I, 0.5), down: f32(H, 0.5) } : undefined;
    const m = matricesFromStored(fn, H, I, gateUp, down, biases);
    const c: PageCase = {
      fn, dtype, H, I, GU: Array.from(m.GU), D: Array.from(m.D),
      rows: vals(n * H, 3, dtype), weights: vals(n, 1, dtype),
    };
    if (m.biasGU && m.biasD) Object.assign(c, { biasGU: Array.from(m.biasGU), biasD: Array.from(m.biasD) });
    return c;
  });
}

const browser = chromium();

test("the WASM kernel runs in a web page (headless Chromium) and computes what it computes under Node", {
  skip: browser === undefined ? "chromium is not installed (make system-deps)" : false,
  timeout: 120_000,
}, async () => {
  const bundle = await build({
    stdin: { contents: PAGE_SCRIPT, resolveDir: join(ROOT, "src", "wasm"), loader: "js", sourcefile: "page.js" },
    bundle: true,
    platform: "browser",
    format: "esm",
    target: "es2022",
    write: false,
    logLevel: "silent",
  });
  const js = bundle.outputFiles[0]!.text;
  assert.doesNotMatch(js, /\bfrom\s*["']node:|require\(["']/, "the browser bundle imports nothing of Node's");
  const cases = pageCases();
  const html = '<!doctype html><meta charset="utf-8"><title>kernel</title><script type="module" src="./page.js">' +
    "</script>";
  let resolve!: (body: string) => void;
  const posted = new Promise<string>((r) => (resolve = r));
  const served = new Set<string>();
  const server = createServer((req, res) => {
    served.add(req.url ?? "");
    const send = (type: string, body: string | Uint8Array): void => {
      res.writeHead(200, { "content-type": type });
      res.end(body);
    };
    if (req.url === "/") send("text/html", html);
    else if (req.url === "/page.js") send("text/javascript", js);
    else if (req.url === "/kernel.wasm") send("application/wasm", readFileSync(WASM));
    else if (req.url === "/cases.json") send("application/json", JSON.stringify({ cases }));
    else if (req.url === "/results" && req.method === "POST") {
      const parts: Buffer[] = [];
      req.on("data", (b: Buffer) => parts.push(b));
      req.on("end", () => {
        send("text/plain", "ok");
        resolve(Buffer.concat(parts).toString("utf8"));
      });
    } else {
      res.writeHead(404);
      res.end();
    }
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const { port } = server.address() as AddressInfo;
  const profile = mkdtempSync(join(tmpdir(), "kvasir-wasm-chromium-"));
  const proc = spawn(browser!, [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
    `--user-data-dir=${profile}`, `http://127.0.0.1:${port}/`,
  ], { stdio: ["ignore", "ignore", "pipe"] });
  let stderr = "";
  proc.stderr!.on("data", (b: Buffer) => (stderr = (stderr + b.toString()).slice(-4000)));
  try {
    const timer = new Promise<never>((_, reject) => {
      const t = setTimeout(() => reject(new Error(`no results from the page in 90 s; chromium:\n${stderr}`)), 90_000);
      posted.finally(() => clearTimeout(t)).catch(() => {});
    });
    const body = JSON.parse(await Promise.race([posted, timer]));
    assert.equal(body.ok, true, `the page failed: ${body.error}`);
    assert.ok(served.has("/kernel.wasm"), "the page fetched kernel.wasm itself");
    const kernel = await WasmKernel.load(readFileSync(WASM));
    cases.forEach((c, i) => {
      const m = { H: c.H, I: c.I, GU: Float32Array.from(c.GU), D: Float32Array.from(c.D) };
      if (c.biasGU && c.biasD) {
        Object.assign(m, { biasGU: Float32Array.from(c.biasGU), biasD: Float32Array.from(c.biasD) });
      }
      const want = kernel.expertForward(c.fn, c.dtype, m, Float32Array.from(c.rows), c.weights, c.dtype);
      assert.deepEqual(body.results[i].out, Array.from(want.out), `case ${i}: out`);
      assert.deepEqual(body.results[i].proj, Array.from(want.proj), `case ${i}: proj`);
    });
  } finally {
    const running = proc.exitCode === null && proc.signalCode === null;
    const exited = running ? new Promise((r) => proc.once("exit", r)) : Promise.resolve();
    proc.kill("SIGKILL");
    await exited;
    server.closeAllConnections();
    await new Promise<void>((r) => server.close(() => r()));
    // Chromium's helpers may still write into the profile for a moment after it is killed: the
    // folder is a temporary one, so a removal that still fails is left to the system.
    try {
      rmSync(profile, { recursive: true, force: true, maxRetries: 10, retryDelay: 200 });
    } catch {}
  }
});
