// A Kvasir worker in TypeScript, written from docs/PROTOCOL.md:
//
//   node --import tsx src/worker/main.ts --hub ws://HOST:PORT --model DIR [--wallet FILE]
//       [--experts SPEC] [--hub-key HEX] [--e2e auto|require] [--aead auto|aes-256-gcm|chacha20-poly1305]
//       [--http2 node|sans-io]
//   node --import tsx src/worker/main.ts --gateway wss://HOST[:PORT] --model DIR ...
//
// It dials out (never listens), proves its wallet, and serves kvasir.v1.ExpertService over
// the tunnel; it redials with backoff after any close, and stops on SIGTERM / SIGINT after
// finishing the calls it computes (close 1001).

import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";

import { closeClass, toHex } from "./bytes.js";
import { AEAD_AES_256_GCM } from "./channel.js";
import { CheckpointError, ExpertIndex } from "./checkpoint.js";
import { isLittleEndian } from "./dtype.js";
import { describeFunction, useExpertKernel } from "./expert.js";
import { functionOfCheckpoint, helloFunction } from "./function.js";
import { isAddress, Wallet } from "./handshake.js";
import { ExpertServer, loadExperts } from "./service.js";
import { Session, type SessionEnd } from "./session.js";
import { WasmKernel, WasmMemoryError, wasmExpertForward } from "../wasm/kernel.js";

export const WORKER_VERSION = "kvasir-ts-worker 0.1.0";
const DEFAULT_WALLET = ".kvasir/wallet.key";
const EXIT_REFUSED = 2;

const USAGE = `usage: main.ts (--hub ws://HOST:PORT | --gateway wss://HOST[:PORT]) --model DIR [--wallet FILE]
               [--experts SPEC] [--hub-key HEX] [--e2e auto|require] [--aead auto|aes-256-gcm|chacha20-poly1305]
               [--ca-file PEM] [--drain-timeout SECONDS] [--kernel js|wasm]
               [--http2 node|sans-io]

  --hub URL          a hub's address (ws://, or wss:// behind TLS); dialled as given (a hub ignores the path)
  --gateway URL      a public gateway: /v1/worker is appended when the URL has no path; --e2e require by default
  --model DIR        the Hugging Face checkpoint folder (config.json, *.safetensors)
  --wallet FILE      the Ed25519 wallet key file (created, mode 0600, if missing; default ${DEFAULT_WALLET})
  --experts SPEC     the slices to serve: all (default), 0-3:0-15, *:0-7, comma-separated
  --hub-key HEX      serve only the hub with this public key (64 hex characters)
  --e2e MODE         require: refuse a session not encrypted end to end; auto: take what the hub decides
  --aead NAME        the AEAD to offer besides the default ChaCha20-Poly1305 (auto: AES-256-GCM)
  --ca-file PEM      extra CA certificates to verify a wss:// gateway
  --drain-timeout S  seconds to finish in-flight calls on SIGTERM (default 10)
  --kernel NAME      js: compute in JavaScript (default); wasm: the WebAssembly SIMD kernel (src/wasm/)
  --http2 IMPL       the HTTP/2 server of the tunnel's connections: node (node:http2, default) or sans-io
                     (src/h2: HTTP/2, HPACK and gRPC in plain TypeScript, as a web page would run them)`;

function log(line: string): void {
  process.stderr.write(`${new Date().toISOString()} worker: ${line}\n`);
}

function die(line: string, code = EXIT_REFUSED): never {
  process.stderr.write(`worker: ${line}\n`);
  process.exit(code);
}

function dialUrl(hub: string | undefined, gateway: string | undefined): { url: string; gateway: boolean } {
  const value = hub ?? gateway;
  if (value === undefined || (hub !== undefined && gateway !== undefined)) die(`give exactly one of --hub or --gateway\n${USAGE}`);
  let u: URL;
  try {
    u = new URL(value);
  } catch {
    die(`${hub ? "--hub" : "--gateway"} ${value}: not a URL (ws://HOST:PORT or wss://HOST[:PORT])`);
  }
  if (u.protocol !== "ws:" && u.protocol !== "wss:") die(`${hub ? "--hub" : "--gateway"} ${value}: the scheme must be ws:// or wss://`);
  if (gateway !== undefined && (u.pathname === "" || u.pathname === "/")) u.pathname = "/v1/worker";
  return { url: u.toString(), gateway: gateway !== undefined };
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      hub: { type: "string" },
      gateway: { type: "string" },
      model: { type: "string" },
      wallet: { type: "string", default: DEFAULT_WALLET },
      experts: { type: "string", default: "all" },
      "hub-key": { type: "string" },
      e2e: { type: "string" },
      aead: { type: "string", default: "auto" },
      "ca-file": { type: "string" },
      "drain-timeout": { type: "string", default: "10" },
      http2: { type: "string", default: "node" },
      kernel: { type: "string", default: "js" },
      help: { type: "boolean", short: "h" },
    },
    strict: true,
  });
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    return;
  }
  if (!isLittleEndian()) die("this worker reads tensors as little-endian typed arrays: a big-endian machine is not supported");
  const { url, gateway } = dialUrl(values.hub, values.gateway);
  if (!values.model) die(`--model is required\n${USAGE}`);
  const hubKey = values["hub-key"];
  if (hubKey !== undefined && !isAddress(hubKey)) die(`--hub-key ${hubKey}: expected 64 lowercase hex characters`);
  const e2e = values.e2e ?? (gateway ? "require" : "auto");
  if (e2e !== "auto" && e2e !== "require") die(`--e2e ${e2e}: auto or require`);
  const aeadOffer: Record<string, number[]> = { auto: [AEAD_AES_256_GCM], "aes-256-gcm": [AEAD_AES_256_GCM], "chacha20-poly1305": [] };
  const aeads = aeadOffer[values.aead];
  if (aeads === undefined) die(`--aead ${values.aead}: auto, aes-256-gcm or chacha20-poly1305`);
  const drainMs = Number(values["drain-timeout"]) * 1000;
  if (!(drainMs >= 0)) die(`--drain-timeout ${values["drain-timeout"]}: a number of seconds`);
  const ca = values["ca-file"] ? readFileSync(values["ca-file"]) : undefined;
  const http2 = values.http2;
  if (http2 !== "node" && http2 !== "sans-io") die(`--http2 ${http2}: node or sans-io`);
  if (http2 === "sans-io") log("serving gRPC with the sans-IO HTTP/2 server (src/h2)");
  if (values.kernel !== "js" && values.kernel !== "wasm") die(`--kernel ${values.kernel}: js or wasm`);

  let wallet: Wallet;
  try {
    wallet = Wallet.loadOrCreate(values.wallet);
  } catch (exc) {
    die(`--wallet ${values.wallet}: ${exc instanceof Error ? exc.message : String(exc)}`);
  }

  let server: ExpertServer;
  try {
    const t0 = Date.now();
    const index = new ExpertIndex(values.model);
    const fn = functionOfCheckpoint(index);
    const experts = loadExperts(index, values.experts, fn);
    if (values.kernel === "wasm") {
      // Every expert's weights into the kernel's memory now: one the device cannot hold stops the start.
      const k = await WasmKernel.load(readFileSync(new URL("../wasm/kernel.wasm", import.meta.url)));
      for (const [layer, ids] of experts.slices) for (const id of ids) k.place(experts.get(layer, id)!);
      useExpertKernel(wasmExpertForward(k));
      log(`kernel: WebAssembly SIMD, ${(k.placedBytes / 2 ** 20).toFixed(1)} MiB of weights placed`);
    }
    server = new ExpertServer(experts, { wallet: wallet.address, device: "cpu" });
    log(
      `loaded ${experts.count} experts of ${index.info.modelType} (${experts.dtype}, ${describeFunction(fn)}) in ${Date.now() - t0} ms; ` +
        `digest ${toHex(experts.weightsDigest).slice(0, 16)}…; wallet ${wallet.address}`,
    );
  } catch (exc) {
    if (exc instanceof CheckpointError) die(`--model ${values.model}: ${exc.message}`);
    if (exc instanceof WasmMemoryError) die(`--kernel wasm: ${exc.message}`);
    throw exc;
  }

  const e = server.experts;
  let stopping = false;
  let current: Session | undefined;
  const stop = async (signal: string): Promise<void> => {
    if (stopping) return;
    stopping = true;
    log(`${signal}: finishing in-flight calls, then closing 1001`);
    const drained = await server.drain(drainMs);
    if (!drained) log(`calls still computing after ${drainMs / 1000} s; closing anyway`);
    current?.close(1001, "worker shutting down");
    if (current) await Promise.race([current.done, sleep(3000)]);
    process.exit(0);
  };
  process.on("SIGTERM", () => void stop("SIGTERM"));
  process.on("SIGINT", () => void stop("SIGINT"));

  let backoff = 250;
  while (!stopping) {
    log(`dialling ${url}`);
    current = new Session({
      url,
      server,
      hello: {
        wallet,
        slices: e.slices,
        weightsDigest: e.weightsDigest,
        device: "cpu",
        modelType: e.modelType,
        workerVersion: WORKER_VERSION,
        projections: true,
        extra: helloFunction(e.fn),
      },
      handshake: { expectedHubKey: hubKey, requireEncryption: e2e === "require", aeads },
      ca,
      log,
      http2,
    });
    const end: SessionEnd = await current.run();
    if (stopping) break;
    log(`session over: ${end.code ?? "-"} ${end.reason}`.trimEnd());
    if (end.fatal) die(`refused (${end.code ?? "HTTP"}): ${end.reason}; not dialling again unchanged`);
    let wait: number;
    // After a live session: at once, unless its close code says "retry" (then the backoff, from its start).
    if (end.established) backoff = 250;
    if (end.established && (end.code === undefined || closeClass(end.code) !== "retry")) {
      wait = 50;
    } else {
      wait = backoff * (0.5 + Math.random());
      backoff = Math.min(backoff * 2, 30_000);
    }
    if (end.retryAfterMs !== undefined) wait = Math.max(wait, end.retryAfterMs);
    await sleep(wait);
  }
}

main().catch((exc: unknown) => {
  process.stderr.write(`worker: ${exc instanceof Error ? (exc.stack ?? exc.message) : String(exc)}\n`);
  process.exit(1);
});
