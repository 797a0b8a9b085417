// The expert kernel in WebAssembly with 128-bit SIMD (kernel.wasm, built from kernel.as.ts by
// `npm run build:wasm`): what src/worker/expert.ts's expertForward computes, with the same
// signature and results up to the summation order of the matrix products (float32 here,
// float64 there; PROTOCOL.md 11 allows any order accumulating in at least float32).
//
// Browser-safe: no Node API. The caller gives the module's bytes (or a Response, a compiled
// module), or lets `WasmKernel.load()` fetch kernel.wasm beside this file. Each expert's weights
// are copied into the module's memory once, the first time it is used (or by `place`), and stay
// there; the memory grows as experts and rows need it, and a device that cannot hold an expert
// gets a `WasmMemoryError` saying so.

import type { FloatDType } from "../worker/dtype.js";
import { wider } from "../worker/dtype.js";
import { unsupported, type ExpertFunction, type ExpertMatrices, type ExpertResult } from "../worker/expert.js";

// The few WebAssembly and fetch declarations used here (the project's lib is ES2022 without
// the DOM's; these are the standard ones, resolved at run time to the global objects).
interface WasmMemory {
  readonly buffer: ArrayBuffer;
  grow(pages: number): number;
}
interface WasmInstance {
  readonly exports: Record<string, unknown>;
}
interface WasmResponse {
  arrayBuffer(): Promise<ArrayBuffer>;
  clone(): WasmResponse;
  readonly ok: boolean;
  readonly status: number;
  readonly url: string;
}
type WasmModule = object;
declare const WebAssembly: {
  instantiate(bytes: BufferSource): Promise<{ module: WasmModule; instance: WasmInstance }>;
  instantiate(module: WasmModule): Promise<WasmInstance>;
  instantiateStreaming?(
    source: WasmResponse | PromiseLike<WasmResponse>,
  ): Promise<{ module: WasmModule; instance: WasmInstance }>;
  validate(bytes: BufferSource): boolean;
  Module: abstract new (...args: never[]) => WasmModule;
  CompileError: abstract new (...args: never[]) => Error;
};
declare const fetch: (url: string | URL) => Promise<WasmResponse>;
type BufferSource = ArrayBuffer | ArrayBufferView;

/** Where kernel.wasm lies beside this module (a page serves both; `WasmKernel.load()` fetches it). */
export const KERNEL_WASM_URL: URL = new URL("./kernel.wasm", import.meta.url);

/** The device cannot hold what the kernel needs (an expert's weights, a call's rows). */
export class WasmMemoryError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "WasmMemoryError";
  }
}

interface KernelExports {
  memory: WasmMemory;
  heapBase(): number;
  forward(
    H: number, I: number, H8: number, I8: number, gu: number, d: number, bgu: number, bd: number, wbf16: number,
    n: number, x: number, w: number, proj: number, h: number, out: number,
    gate: number, act: number, alpha: number, limit: number, cdt: number, odt: number,
  ): void;
}

const PAGE = 65536;
/** WebAssembly's 32-bit memories end at 4 GiB (65536 pages); engines may give less. */
const MAX_PAGES = 65536;
const DTYPE_CODE: Record<FloatDType, number> = { float32: 0, bfloat16: 1, float16: 2 };
const GATE_CODE = new Map<string, number>([["glu", 0], ["clamped_glu", 1], ["clamped_swiglu", 2]]);
/** The activations kernel.as.ts computes, by their `hidden_act` names (those of expert.ts). */
export const WASM_ACTIVATIONS: ReadonlyMap<string, number> = new Map([
  ["silu", 0], ["swish", 0], ["relu", 1], ["gelu", 2], ["gelu_pytorch_tanh", 3], ["gelu_new", 4],
]);
const ACT_CODE = WASM_ACTIVATIONS;

const align16 = (n: number): number => Math.ceil(n / 16) * 16;
const pad8 = (n: number): number => Math.ceil(n / 8) * 8;
const mib = (bytes: number): string => `${(bytes / 2 ** 20).toFixed(1)} MiB`;

/** An expert's weights in the module's memory (byte offsets). */
interface Placed {
  H: number;
  I: number;
  gu: number;
  d: number;
  bgu: number; // 0: none
  bd: number;
  bf16: boolean; // stored as bfloat16 bits (every weight was a bfloat16 value), else float32
  bytes: number;
}

export interface WasmKernelOptions {
  /** Rows computed per call into the module (a call of more rows runs in blocks): bounds the scratch memory. */
  blockRows?: number;
  /** The most memory the kernel may take, in bytes (at most 4 GiB). */
  maxBytes?: number;
}

/** Whether every value of `a` is a bfloat16 value (the low 16 bits of its float32 bits zero). */
function allBf16(a: Float32Array): boolean {
  const u = new Uint32Array(a.buffer, a.byteOffset, a.length);
  for (let i = 0; i < u.length; i++) if (u[i]! & 0xffff) return false;
  return true;
}

export class WasmKernel {
  readonly #x: KernelExports;
  #placed = new WeakMap<ExpertMatrices, Placed>();
  readonly #blockRows: number;
  readonly #maxPages: number;
  readonly #base: number;
  #top: number; // the first byte after the placed experts: each call's scratch starts here
  #held = 0;

  private constructor(instance: WasmInstance, options: WasmKernelOptions) {
    this.#x = instance.exports as unknown as KernelExports;
    if (typeof this.#x.forward !== "function" || !this.#x.memory) throw new Error("not the expert kernel's module");
    this.#base = align16(this.#x.heapBase());
    this.#top = this.#base;
    this.#blockRows = Math.max(4, Math.floor((options.blockRows ?? 256) / 4) * 4);
    this.#maxPages = Math.min(MAX_PAGES, Math.floor((options.maxBytes ?? MAX_PAGES * PAGE) / PAGE));
  }

  /**
   * The kernel from kernel.wasm: its bytes, a (pending) fetch Response, or a compiled module;
   * none: fetched from KERNEL_WASM_URL (a browser's; Node's fetch reads no file: URL, so a Node
   * caller passes the bytes).
   */
  static async load(
    source?: BufferSource | WasmResponse | PromiseLike<WasmResponse> | WasmModule,
    options: WasmKernelOptions = {},
  ): Promise<WasmKernel> {
    try {
      let instance: WasmInstance;
      if (source === undefined) source = fetch(KERNEL_WASM_URL);
      if (source instanceof WebAssembly.Module) {
        instance = await WebAssembly.instantiate(source);
      } else if (source instanceof ArrayBuffer || ArrayBuffer.isView(source)) {
        instance = (await WebAssembly.instantiate(source)).instance;
      } else {
        const response = await (source as WasmResponse | PromiseLike<WasmResponse>);
        if (!response.ok) throw new Error(`fetching ${response.url || "kernel.wasm"}: HTTP ${response.status}`);
        instance = await instantiateResponse(response);
      }
      return new WasmKernel(instance, options);
    } catch (exc) {
      if (exc instanceof WebAssembly.CompileError) {
        const why = `the WASM expert kernel does not compile here (it needs WebAssembly 128-bit SIMD)`;
        throw new Error(`${why}: ${exc.message}`);
      }
      throw exc;
    }
  }

  /** Bytes of the module's memory now (its weights, the largest call's scratch). */
  get memoryBytes(): number {
    return this.#x.memory.buffer.byteLength;
  }

  /** Bytes of expert weights placed. */
  get placedBytes(): number {
    return this.#held;
  }

  /** Forget every placed expert (the memory stays: WebAssembly's never shrinks; later experts reuse it). */
  reset(): void {
    this.#placed = new WeakMap();
    this.#top = this.#base;
    this.#held = 0;
  }

  /** Copy `m`'s weights into the module's memory, unless they are there already. */
  place(m: ExpertMatrices): void {
    if (this.#placed.has(m)) return;
    const { H, I } = m;
    if (m.GU.length !== 2 * I * H || m.D.length !== H * I) {
      throw new Error(`expert matrices of ${m.GU.length} and ${m.D.length} values, expected ${2 * I * H} and ${H * I}`);
    }
    const H8 = pad8(H);
    const I8 = pad8(I);
    const bf16 = allBf16(m.GU) && allBf16(m.D);
    const size = bf16 ? 2 : 4;
    const guBytes = align16(2 * I * H8 * size);
    const dBytes = align16(H * I8 * size);
    // Each bias when the matrices have it (as the JS kernel adds it).
    const bguBytes = m.biasGU ? align16(2 * I * 4) : 0;
    const bdBytes = m.biasD ? align16(H * 4) : 0;
    const bytes = guBytes + dBytes + bguBytes + bdBytes;
    const at = this.#top;
    this.#reserve(at + bytes, () => `expert [H ${H}, I ${I}] (${mib(bytes)} of weights)`);
    const buf = this.#x.memory.buffer;
    const p: Placed = { H, I, gu: at, d: at + guBytes, bgu: 0, bd: 0, bf16, bytes };
    if (bf16) {
      copyRowsBf16(new Uint16Array(buf, p.gu, 2 * I * H8), m.GU, 2 * I, H, H8);
      copyRowsBf16(new Uint16Array(buf, p.d, H * I8), m.D, H, I, I8);
    } else {
      copyRows(new Float32Array(buf, p.gu, 2 * I * H8), m.GU, 2 * I, H, H8);
      copyRows(new Float32Array(buf, p.d, H * I8), m.D, H, I, I8);
    }
    if (m.biasGU) {
      p.bgu = p.d + dBytes;
      new Float32Array(buf, p.bgu, 2 * I).set(m.biasGU);
    }
    if (m.biasD) {
      p.bd = p.d + dBytes + bguBytes;
      new Float32Array(buf, p.bd, H).set(m.biasD);
    }
    this.#top = at + bytes;
    this.#held += bytes;
    this.#placed.set(m, p);
  }

  /**
   * One expert over `n` rows, as expert.ts's expertForward: `rows` [n, H] (values of the compute
   * dtype), `weights` [n] (values of `weightsDType`); `m`'s weights are placed on first use.
   */
  expertForward(
    fn: ExpertFunction,
    dtype: FloatDType,
    m: ExpertMatrices,
    rows: Float32Array,
    weights: ArrayLike<number>,
    weightsDType: FloatDType,
  ): ExpertResult {
    const { H, I } = m;
    const n = weights.length;
    if (rows.length !== n * H) throw new Error(`expertForward: ${rows.length} values for ${n} rows of ${H}`);
    // As the JS kernel: a gate or activation it does not compute is refused (unsupported() says why);
    // the biases are the matrices' (matricesFromStored gives them when the function has them).
    const gate = GATE_CODE.get(fn.gate);
    const act = fn.gate === "clamped_swiglu" ? 0 : ACT_CODE.get(fn.activation);
    if (gate === undefined || act === undefined) {
      throw new Error(unsupported(fn) ?? `${JSON.stringify(fn.activation)} is not implemented by the WASM kernel`);
    }
    const outDType = wider(dtype, weightsDType);
    const proj = new Float32Array(n * 2 * I);
    const out = new Float64Array(n * H);
    if (n === 0) return { out, outDType, proj };
    this.place(m);
    const p = this.#placed.get(m)!;
    const H8 = pad8(H);
    const I8 = pad8(I);
    const block = Math.min(n, this.#blockRows);
    // The scratch of one block of rows: x [b, H8], w [b], proj [b, 2I], h [b, I8], out [b, H].
    const xAt = this.#top;
    const wAt = xAt + align16(block * H8 * 4);
    const pAt = wAt + align16(block * 4);
    const hAt = pAt + align16(block * 2 * I * 4);
    const oAt = hAt + align16(block * I8 * 4);
    this.#reserve(oAt + align16(block * H * 4), () => `a block of ${block} rows of expert [H ${H}, I ${I}]`);
    const buf = this.#x.memory.buffer;
    const xv = new Float32Array(buf, xAt, block * H8);
    const wv = new Float32Array(buf, wAt, block);
    const pv = new Float32Array(buf, pAt, block * 2 * I);
    const ov = new Float32Array(buf, oAt, block * H);
    for (let r0 = 0; r0 < n; r0 += block) {
      const b = Math.min(block, n - r0);
      copyRows(xv, rows.subarray(r0 * H, (r0 + b) * H), b, H, H8);
      for (let r = 0; r < b; r++) wv[r] = weights[r0 + r]!;
      this.#x.forward(
        H, I, H8, I8, p.gu, p.d, p.bgu, p.bd, p.bf16 ? 1 : 0,
        b, xAt, wAt, pAt, hAt, oAt,
        gate, act, fn.alpha, fn.limit, DTYPE_CODE[dtype], DTYPE_CODE[outDType],
      );
      proj.set(pv.subarray(0, b * 2 * I), r0 * 2 * I);
      out.set(ov.subarray(0, b * H), r0 * H);
    }
    return { out, outDType, proj };
  }

  /** Grow the memory to hold `end` bytes, or say what does not fit. */
  #reserve(end: number, what: () => string): void {
    const have = this.#x.memory.buffer.byteLength;
    if (end <= have) return;
    const pages = Math.ceil(end / PAGE);
    const cannot = (why: string): WasmMemoryError =>
      new WasmMemoryError(
        `the WASM kernel cannot hold ${what()}: its memory would grow from ${mib(have)} to ${mib(pages * PAGE)} ` +
          `(${mib(this.#held)} of experts placed already), ${why}`,
      );
    if (pages > this.#maxPages) throw cannot(`past its limit of ${mib(this.#maxPages * PAGE)}`);
    try {
      this.#x.memory.grow(pages - have / PAGE);
    } catch (exc) {
      throw cannot(`which this device refused (${exc instanceof Error ? exc.message : String(exc)})`);
    }
  }
}

/** The rows [rows, cols] of `src` into `dst` [rows, stride] (float32), each padded with zeros. */
function copyRows(dst: Float32Array, src: Float32Array, rows: number, cols: number, stride: number): void {
  if (cols === stride) {
    dst.set(src.subarray(0, rows * cols));
    return;
  }
  for (let r = 0; r < rows; r++) {
    dst.set(src.subarray(r * cols, r * cols + cols), r * stride);
    dst.fill(0, r * stride + cols, r * stride + stride);
  }
}

/** As copyRows, into bfloat16 bits (the values are bfloat16 values: exact). */
function copyRowsBf16(dst: Uint16Array, src: Float32Array, rows: number, cols: number, stride: number): void {
  const bits = new Uint32Array(src.buffer, src.byteOffset, src.length);
  for (let r = 0; r < rows; r++) {
    const s = r * cols;
    const d = r * stride;
    for (let k = 0; k < cols; k++) dst[d + k] = bits[s + k]! >>> 16;
    dst.fill(0, d + cols, d + stride);
  }
}

/** Compile a fetched kernel.wasm, streaming where the engine can (it needs the application/wasm type). */
async function instantiateResponse(response: WasmResponse): Promise<WasmInstance> {
  if (typeof WebAssembly.instantiateStreaming === "function") {
    try {
      return (await WebAssembly.instantiateStreaming(response.clone())).instance;
    } catch (exc) {
      if (exc instanceof WebAssembly.CompileError) throw exc;
      // A server that labels it otherwise: compile from the bytes.
    }
  }
  return (await WebAssembly.instantiate(await response.arrayBuffer())).instance;
}

/** The kernel as a function of expertForward's signature (src/worker/expert.ts). */
export function wasmExpertForward(kernel: WasmKernel): WasmKernel["expertForward"] {
  return kernel.expertForward.bind(kernel);
}
