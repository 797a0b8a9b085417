// The worker of the page, without the page: the wallet, the slice chosen to fit the device's
// memory and fetched by the byte, the experts checked and digested, the kernel (WebAssembly
// SIMD where it loads, else JavaScript), and sessions dialled again after each close as the
// close code says (PROTOCOL.md 7). It uses no DOM: it runs in the page's dedicated worker thread
// (thread.ts), or on the page's main thread where no module worker starts; the page (page.ts)
// shows `WorkerState` and drives start/stop through thread.ts's messages.

import { closeClass, CloseCode, toHex } from "../../ts/src/worker/bytes_core.js";
import { AEAD_AES_256_GCM } from "../../ts/src/worker/channel_core.js";
import { expertDigestChunks, slicesDigestChunks } from "../../ts/src/worker/digest_core.js";
import { isLittleEndian } from "../../ts/src/worker/dtype.js";
import { describeFunction, expertForward, useExpertKernel, type ExpertMatrices } from "../../ts/src/worker/expert.js";
import { functionOfCheckpoint, helloFunction } from "../../ts/src/worker/function.js";
import { ExpertServiceCore, planExperts, prepareExpert, servedExperts } from "../../ts/src/worker/service_core.js";
import { WasmKernel, wasmExpertForward } from "../../ts/src/wasm/kernel.js";
import { WebGpuDeviceLostError, WebGpuKernel, webgpuExpertForward } from "../../ts/src/webgpu/kernel.js";
import { cryptoSupport, sha256Chunks } from "./crypto.js";
import { RemoteCheckpoint } from "./fetch.js";
import { WebSession, type WebSessionEnd } from "./session.js";
import type { WebWallet } from "./wallet.js";

export const WORKER_VERSION = "kvasir-web-worker 0.1.0";
/** Without navigator.deviceMemory (Firefox, Safari) the slice is kept to this much weight memory. */
export const DEFAULT_BUDGET_BYTES = 512 << 20;
/** Of navigator.deviceMemory (a coarse figure, rounded down), the share the weights may take. */
export const DEVICE_MEMORY_SHARE = 0.25;
/** At most this much whatever the device: a tab's heap, and WebAssembly's 4 GiB memory (which
 * holds a second copy of the weights with the WebAssembly kernel). */
export const MAX_BUDGET_BYTES = 2 ** 31;

export interface WorkerOptions {
  /** ws://HOST:PORT of a hub, or wss://HOST[:PORT][/v1/worker] of a gateway. */
  url: string;
  model: string;
  wallet: WebWallet;
  /** The experts to consider (the Python worker's SPEC); trimmed to the memory budget. */
  experts: string;
  /** The weight memory budget in bytes; undefined: from navigator.deviceMemory, else the default. */
  budgetBytes: number | undefined;
  /** `auto`: WebGPU on a hardware adapter, else WebAssembly SIMD; `webgpu`: WebGPU on any adapter,
   * a software one too (SwiftShader: slower than WebAssembly), else WebAssembly; `wasm`; `js`. */
  kernel: KernelChoice;
  /** Where kernel.wasm is (beside the bundle). */
  wasmUrl: string;
  /** Refuse a session not sealed end to end; undefined: required through a gateway (wss://) only. */
  requireEncryption?: boolean | undefined;
}

export type KernelChoice = "auto" | "webgpu" | "wasm" | "js";
export const KERNEL_CHOICES: readonly KernelChoice[] = ["auto", "webgpu", "wasm", "js"];

/** A kernel choice from text (a query parameter): unknown text is `auto`. */
export function kernelChoice(text: string | null | undefined): KernelChoice {
  return (KERNEL_CHOICES as readonly string[]).includes(text ?? "") ? (text as KernelChoice) : "auto";
}

export type Phase = "idle" | "loading" | "connecting" | "connected" | "waiting" | "stopped" | "refused" | "failed";

export interface WorkerState {
  phase: Phase;
  /** One line on the phase: what it is doing, or why it is not connected. */
  detail: string;
  lastClose: { code: number | undefined; reason: string; meaning: string } | undefined;
  experts: number;
  layers: number;
  slices: string;
  kernel: string;
  encrypted: boolean;
  sessionId: string;
  calls: number;
  rows: number;
  fetchedBytes: number;
  loadMs: number;
  /** Milliseconds from start() to the first call served (undefined until then). */
  firstCallMs: number | undefined;
  log: string[];
}

/** What a close code means for someone looking at the page (PROTOCOL.md 7). */
export function closeMeaning(code: number | undefined): string {
  if (code === undefined) return "no connection was made";
  const names: Record<number, string> = {
    1000: "closed normally",
    1001: "going away (the hub or worker is shutting down)",
    1002: "protocol error",
    1006: "the connection dropped without a close frame",
    1008: "policy violation (a check of the handshake or channel failed)",
    1009: "a message too big",
    1011: "internal error",
    1013: "try again later (the hub is busy)",
    [CloseCode.REFUSED]: "refused by the hub: not dialling again unchanged",
    [CloseCode.REPLAN]: "the hub asks for a new plan",
    [CloseCode.HELLO_INVALID]: "the hello is invalid",
    [CloseCode.QUARANTINED]: "this wallet is quarantined (an audit failed)",
    [CloseCode.OUTSIDE_MODEL]: "these experts are outside the hub's model",
    [CloseCode.E2E_MISMATCH]: "end-to-end encryption: the two sides disagree",
    [CloseCode.HUB_KEY_MISMATCH]: "not the hub this worker pins",
    [CloseCode.HANDSHAKE_TIMEOUT]: "the handshake timed out",
    [CloseCode.HELLO_STALE]: "the hello was stale (the clock, or a slow handshake)",
    [CloseCode.WALLET_CAP]: "too many sessions for this wallet",
    [CloseCode.ADDRESS_CAP]: "too many sessions from this address",
    [CloseCode.HUB_FULL]: "the hub is full",
    [CloseCode.RATE_LIMITED]: "dialling too often",
    [CloseCode.NO_HUB]: "the gateway has no hub for this worker now",
    [CloseCode.PAIRING_TIMEOUT]: "the gateway could not pair this worker with a hub in time",
    [CloseCode.BUFFERS_FULL]: "the gateway's buffers are full",
    [CloseCode.MESSAGE_TIMEOUT]: "a message took too long",
    [CloseCode.PAIRING_GONE]: "the hub of this pairing went away",
  };
  const cls = closeClass(code);
  const what = {
    permanent: "permanent: not dialling again unchanged",
    retry: "dialling again after a backoff",
    replan: "dialling again",
    closed: "dialling again",
  }[cls];
  return `${names[code] ?? "unassigned code"} (${what})`;
}

/** The weight memory budget: the override, else a share of navigator.deviceMemory, else the default. */
export function memoryBudget(override: number | undefined): { bytes: number; source: string } {
  if (override !== undefined && override > 0) return { bytes: override, source: "set on the page" };
  const dm = (globalThis.navigator as { deviceMemory?: number } | undefined)?.deviceMemory;
  if (typeof dm === "number" && dm > 0) {
    const bytes = Math.min(MAX_BUDGET_BYTES, Math.floor(dm * 2 ** 30 * DEVICE_MEMORY_SHARE));
    return { bytes, source: `${DEVICE_MEMORY_SHARE * 100}% of navigator.deviceMemory (${dm} GiB), at most 2 GiB` };
  }
  return { bytes: DEFAULT_BUDGET_BYTES, source: "the default (this browser does not say its memory)" };
}

function formatSlices(slices: Map<number, number[]>): string {
  const parts: string[] = [];
  for (const [l, es] of slices) {
    const runs: string[] = [];
    let i = 0;
    while (i < es.length) {
      let j = i;
      while (j + 1 < es.length && es[j + 1] === es[j]! + 1) j++;
      runs.push(i === j ? `${es[i]}` : `${es[i]}-${es[j]}`);
      i = j + 1;
    }
    parts.push(`${l}:${runs.join(",")}`);
  }
  return parts.join(" ");
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** The state of a worker not started: `phase` with `detail`. */
export function initialState(phase: Phase = "idle", detail = "not started"): WorkerState {
  return {
    phase,
    detail,
    lastClose: undefined,
    experts: 0,
    layers: 0,
    slices: "",
    kernel: "",
    encrypted: false,
    sessionId: "",
    calls: 0,
    rows: 0,
    fetchedBytes: 0,
    loadMs: 0,
    firstCallMs: undefined,
    log: [],
  };
}

export class PageWorker {
  readonly state: WorkerState = initialState();
  private service: ExpertServiceCore | undefined;
  private session: WebSession | undefined;
  private stopping = false;
  private t0 = 0;
  private wake: (() => void) | undefined;

  constructor(
    private readonly opts: WorkerOptions,
    private readonly changed: () => void,
  ) {}

  log(line: string): void {
    const stamped = `${new Date().toISOString().slice(11, 19)} ${line}`;
    this.state.log.push(stamped);
    if (this.state.log.length > 200) this.state.log.splice(0, this.state.log.length - 200);
    console.log(`kvasir-web-worker: ${line}`);
    this.changed();
  }

  private set(phase: Phase, detail: string): void {
    if (this.stopping && phase !== "stopped") return; // a load still under way after stop() changes nothing
    this.state.phase = phase;
    this.state.detail = detail;
    this.changed();
  }

  /** Counters from the service (the page polls them). */
  refresh(): void {
    if (!this.service) return;
    this.state.calls = this.service.calls;
    this.state.rows = this.service.rows;
    const first = this.service.firstAnsweredAt;
    if (this.state.firstCallMs === undefined && first !== undefined) {
      this.state.firstCallMs = Math.round(first - this.t0);
      this.log(`first call served ${this.state.firstCallMs} ms after start`);
    }
  }

  /** Load the slice and serve until stop() or a permanent refusal. */
  async run(): Promise<void> {
    this.t0 = performance.now();
    try {
      await this.load();
    } catch (exc) {
      this.set("failed", exc instanceof Error ? exc.message : String(exc));
      this.log(`failed to start: ${this.state.detail}`);
      return;
    }
    await this.serve();
  }

  private async load(): Promise<void> {
    if (!isLittleEndian()) {
      throw new Error("this worker reads tensors as little-endian typed arrays: a big-endian machine is not supported");
    }
    const missing = await cryptoSupport();
    if (missing) throw new Error(missing);
    const o = this.opts;
    this.set("loading", `reading ${o.model}`);
    const ckpt = await RemoteCheckpoint.open(o.model);
    const index = ckpt.index;
    const info = index.info;
    const fn = functionOfCheckpoint(index);
    const { dtype, wanted } = planExperts(index, o.experts, fn);
    // Memory: the kernel's float32 matrices (3 H I values), twice with the WebAssembly kernel's copy
    // (and with WebGPU's, which on a phone's GPU shares the same memory).
    const perExpert = 3 * info.hiddenSize * info.intermediateSize * 4 * (o.kernel === "js" ? 1 : 2);
    const budget = memoryBudget(o.budgetBytes);
    const fits = Math.max(1, Math.floor(budget.bytes / perExpert));
    const chosen = wanted.slice(0, fits);
    this.log(
      `${info.modelType}: ${info.numLayers} layers × ${info.numExperts} experts; ` +
        `${chosen.length} of the ${wanted.length} asked fit ` +
        `${(budget.bytes / 2 ** 20).toFixed(0)} MiB (${budget.source}), ${(perExpert / 2 ** 20).toFixed(2)} MiB each`,
    );
    const stored = chosen.reduce((a, [l, e]) => a + ckpt.storedBytes(l, e), 0);
    let got = 0;
    await ckpt.fetchExperts(chosen, (n) => {
      got += n;
      this.state.fetchedBytes = got;
      this.set("loading", `fetching weights: ${(got / 2 ** 20).toFixed(1)} of ${(stored / 2 ** 20).toFixed(1)} MiB`);
    });
    const weights = new Map<string, ExpertMatrices>();
    const digests: [[number, number], Uint8Array][] = [];
    for (const [l, e] of chosen) {
      const p = prepareExpert(index, fn, dtype, l, e);
      digests.push([[l, e], await sha256Chunks(expertDigestChunks(...p.digest))]);
      weights.set(`${l}:${e}`, p.matrices);
    }
    ckpt.release();
    const experts = servedExperts(index, fn, dtype, weights, await sha256Chunks(slicesDigestChunks(digests)));
    const kernel = await this.chooseKernel(experts);
    this.service = new ExpertServiceCore(experts, { wallet: o.wallet.address, device: "browser" });
    this.state.experts = experts.count;
    this.state.layers = experts.slices.size;
    this.state.slices = formatSlices(experts.slices);
    this.state.kernel = kernel;
    this.state.fetchedBytes = ckpt.fetchedBytes || stored;
    this.state.loadMs = Math.round(performance.now() - this.t0);
    this.log(
      `loaded ${experts.count} experts (${dtype}, ${describeFunction(fn)}) in ${this.state.loadMs} ms, ` +
        `${(stored / 2 ** 20).toFixed(2)} MiB fetched; ` +
        `digest ${toHex(experts.weightsDigest).slice(0, 16)}…; kernel ${kernel}`,
    );
  }

  /** The kernel the choice asks for, where it loads (else the next: WebGPU, WebAssembly, JavaScript),
   * every expert placed; its line for the page. */
  private async chooseKernel(experts: ReturnType<typeof servedExperts>): Promise<string> {
    const o = this.opts;
    const each = (place: (m: ExpertMatrices) => void): void => {
      for (const [layer, ids] of experts.slices) for (const id of ids) place(experts.get(layer, id)!);
    };
    const why = (exc: unknown): string => (exc instanceof Error ? exc.message : String(exc));
    // WebAssembly where it loads, else JavaScript: the kernel in use from now on, and its line.
    const wasmOrJs = async (): Promise<string> => {
      try {
        const k = await WasmKernel.load(fetch(o.wasmUrl));
        each((m) => k.place(m));
        useExpertKernel(wasmExpertForward(k));
        return `WebAssembly SIMD (${(k.placedBytes / 2 ** 20).toFixed(1)} MiB placed)`;
      } catch (exc) {
        this.log(`WebAssembly kernel unavailable, computing in JavaScript: ${why(exc)}`);
        useExpertKernel();
        return "JavaScript";
      }
    };
    if (o.kernel === "auto" || o.kernel === "webgpu") {
      try {
        const gpu = await WebGpuKernel.create();
        if (gpu.isFallbackAdapter && o.kernel === "auto") {
          gpu.destroy();
          this.log(`WebGPU's adapter here is ${gpu.adapterInfo}, a software one on the CPU, slower than ` +
            "WebAssembly: computing with WebAssembly (kernel=webgpu insists on it)");
        } else {
          each((m) => gpu.place(m));
          const onGpu = webgpuExpertForward(gpu);
          let fallback: Promise<unknown> | undefined;
          // A lost device (a driver reset, the GPU process gone) fails the calls under way (the
          // backbone computes those itself); the next ones go to WebAssembly, or JavaScript.
          useExpertKernel((...args) => {
            if (gpu.lost === undefined) {
              return Promise.resolve(onGpu(...args)).catch((exc: unknown) => {
                if (exc instanceof WebGpuDeviceLostError) switchAway(exc);
                throw exc;
              });
            }
            return switchAway(new WebGpuDeviceLostError(gpu.lost)).then(() => expertForward(...args));
          });
          const switchAway = (exc: Error): Promise<unknown> => {
            fallback ??= (async () => {
              this.log(`WebGPU stopped working (${exc.message}): computing with WebAssembly from now on`);
              this.state.kernel = await wasmOrJs();
              this.changed();
            })();
            return fallback;
          };
          return `WebGPU on ${gpu.adapterInfo} (${(gpu.placedBytes / 2 ** 20).toFixed(1)} MiB placed)`;
        }
      } catch (exc) {
        this.log(`WebGPU kernel unavailable, computing with WebAssembly: ${why(exc)}`);
      }
    }
    if (o.kernel !== "js") return wasmOrJs();
    useExpertKernel();
    return "JavaScript";
  }

  private async serve(): Promise<void> {
    const o = this.opts;
    const e = this.service!.experts;
    const requireEncryption = o.requireEncryption ?? o.url.startsWith("wss:");
    let backoff = 250;
    while (!this.stopping) {
      this.set("connecting", `dialling ${o.url}`);
      this.session = new WebSession({
        url: o.url,
        grpc: this.service!.grpc,
        wallet: o.wallet,
        hello: {
          slices: e.slices,
          weightsDigest: e.weightsDigest,
          device: "browser",
          modelType: e.modelType,
          workerVersion: WORKER_VERSION,
          projections: true,
          extra: helloFunction(e.fn),
        },
        // Through a gateway the hub is a stranger's relay away: encryption is required by default.
        handshake: { requireEncryption, aeads: [AEAD_AES_256_GCM] },
        log: (line) => this.log(line),
        onLive: (id, encrypted) => {
          this.state.sessionId = id;
          this.state.encrypted = encrypted;
          const how = encrypted ? ", encrypted end to end" : "";
          this.set("connected", `serving ${e.count} experts, session ${id}${how}`);
        },
      });
      const end: WebSessionEnd = await this.session.run();
      this.session = undefined;
      this.state.encrypted = false;
      const meaning = closeMeaning(end.code);
      this.state.lastClose = { code: end.code, reason: end.reason, meaning };
      if (this.stopping) break;
      this.log(`session over: ${end.code ?? "-"} ${end.reason} (${meaning})`);
      if (end.fatal) {
        this.set("refused", `${end.code ?? ""} ${meaning}${end.reason ? `: ${end.reason}` : ""}`);
        return;
      }
      if (end.established) backoff = 250;
      let wait: number;
      if (end.established && (end.code === undefined || closeClass(end.code) !== "retry")) {
        wait = 50;
      } else {
        wait = backoff * (0.5 + Math.random());
        backoff = Math.min(backoff * 2, 30_000);
      }
      const why = `${end.code ?? ""} ${meaning}${end.reason ? `: ${end.reason}` : ""}`;
      this.set("waiting", `${why}; dialling again in ${(wait / 1000).toFixed(1)} s`);
      await Promise.race([sleep(wait), new Promise<void>((r) => (this.wake = r))]);
    }
    this.set("stopped", "stopped on this page");
  }

  /** Finish the calls being computed (at most `drainMs`), close 1001 and do not dial again. */
  async stop(drainMs = 5000): Promise<void> {
    if (this.stopping) return;
    this.stopping = true;
    this.wake?.();
    if (this.service && !(await this.service.drain(drainMs))) {
      this.log(`calls still computing after ${drainMs / 1000} s; closing anyway`);
    }
    const s = this.session;
    s?.close(1001, "worker page stopped");
    if (s) await Promise.race([s.done, sleep(3000)]);
    this.set("stopped", "stopped on this page");
  }
}
