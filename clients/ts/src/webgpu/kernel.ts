// The expert kernel on WebGPU, for browsers that have it: what src/worker/expert.ts's
// jsExpertForward computes, with the same arguments and results up to the summation order of the
// two matrix products.
//
// The GPU computes only the two matrix products, in float32 (PROTOCOL.md 11, "Precision": the
// products may sum in any order accumulating in at least float32, and round once to the model's
// dtype):
//
//   pass 1  S1[r, j] = sum_k GU[j, k] x[r, k]     GU [2I, H]: the gate rows, then the up rows
//   pass 2  S2[r, i] = sum_j  D[i, j] h[r, j]     D [H, I]
//
// Everything elementwise (each sum rounded once to the compute dtype, the biases, the activation,
// h = act(g) * u with its rounding at each step, the routing weight, the rounding to the output
// dtype) is JavaScript: expert.ts's expertSteps, the very functions jsExpertForward uses. WGSL's
// exp() is only accurate to 3 + 2|x| ULP, so an activation on the GPU would not be the
// step-by-step float32 computation the contract asks for.
//
// Browser-safe: no Node API; the few WebGPU declarations used are below (the project's lib has no
// WebGPU types; these are the standard ones, resolved at run time to the browser's objects).
// Each expert's GU and D are uploaded once (`place`, or its first call) into storage buffers held
// for the ExpertMatrices object (a WeakMap), as bfloat16 when every weight is a bfloat16 value (a
// bfloat16 model's: half the memory and the reads; widened exactly in the shader), else as
// float32; each call uses a scratch that grows as calls need it.
// Calls are asynchronous (the results come back with mapAsync) and run one after another.

import type { FloatDType } from "../worker/dtype.js";
import {
  expertSteps,
  type ExpertFunction,
  type ExpertKernel,
  type ExpertMatrices,
  type ExpertResult,
  type ExpertSteps,
} from "../worker/expert.js";

// -- the WebGPU API used here (https://www.w3.org/TR/webgpu/) ----------------------------------

export interface GpuLimits {
  readonly maxStorageBufferBindingSize: number;
  readonly maxBufferSize: number;
  readonly maxComputeWorkgroupsPerDimension: number;
  readonly maxComputeInvocationsPerWorkgroup: number;
  readonly maxComputeWorkgroupStorageSize: number;
}
export interface GpuBuffer {
  readonly size: number;
  mapAsync(mode: number, offset?: number, size?: number): Promise<void>;
  getMappedRange(offset?: number, size?: number): ArrayBuffer;
  unmap(): void;
  destroy(): void;
}
interface GpuBindGroupLayout {
  readonly label: string;
}
interface GpuBindGroup {
  readonly label: string;
}
interface GpuComputePipeline {
  getBindGroupLayout(index: number): GpuBindGroupLayout;
}
interface GpuShaderModule {
  readonly label: string;
}
interface GpuCommandBuffer {
  readonly label: string;
}
interface GpuComputePass {
  setPipeline(p: GpuComputePipeline): void;
  setBindGroup(index: number, group: GpuBindGroup): void;
  dispatchWorkgroups(x: number, y?: number, z?: number): void;
  end(): void;
}
interface GpuCommandEncoder {
  beginComputePass(descriptor?: { label?: string }): GpuComputePass;
  copyBufferToBuffer(src: GpuBuffer, srcOffset: number, dst: GpuBuffer, dstOffset: number, size: number): void;
  finish(): GpuCommandBuffer;
}
interface GpuQueue {
  writeBuffer(buffer: GpuBuffer, offset: number, data: ArrayBufferView, dataOffset?: number, size?: number): void;
  submit(buffers: GpuCommandBuffer[]): void;
}
interface GpuError {
  readonly message: string;
}
export interface GpuDevice {
  readonly limits: GpuLimits;
  readonly queue: GpuQueue;
  readonly lost: Promise<{ readonly reason: string; readonly message: string }>;
  createBuffer(descriptor: { size: number; usage: number; mappedAtCreation?: boolean; label?: string }): GpuBuffer;
  createShaderModule(descriptor: { code: string; label?: string }): GpuShaderModule;
  createComputePipelineAsync(descriptor: {
    layout: "auto";
    compute: { module: GpuShaderModule; entryPoint: string };
    label?: string;
  }): Promise<GpuComputePipeline>;
  createBindGroup(descriptor: {
    layout: GpuBindGroupLayout;
    entries: { binding: number; resource: { buffer: GpuBuffer; offset?: number; size?: number } }[];
  }): GpuBindGroup;
  createCommandEncoder(): GpuCommandEncoder;
  pushErrorScope(filter: "validation" | "out-of-memory" | "internal"): void;
  popErrorScope(): Promise<GpuError | null>;
  destroy(): void;
}
export interface GpuAdapterInfo {
  readonly vendor?: string;
  readonly architecture?: string;
  readonly device?: string;
  readonly description?: string;
  readonly isFallbackAdapter?: boolean;
}
export interface GpuAdapter {
  readonly limits: GpuLimits;
  readonly info?: GpuAdapterInfo;
  readonly isFallbackAdapter?: boolean;
  requestDevice(descriptor?: { requiredLimits?: Record<string, number>; label?: string }): Promise<GpuDevice>;
}
/** `navigator.gpu`. */
export interface Gpu {
  requestAdapter(options?: { powerPreference?: "low-power" | "high-performance" }): Promise<GpuAdapter | null>;
}

// The standard flags (GPUBufferUsage, GPUMapMode), by value: a Node typecheck has no such globals.
const MAP_READ = 0x0001;
const COPY_SRC = 0x0004;
const COPY_DST = 0x0008;
const UNIFORM = 0x0040;
const STORAGE = 0x0080;
const MAP_MODE_READ = 0x0001;

// -- errors --------------------------------------------------------------------------------

/** No WebGPU here (no navigator.gpu, no adapter, no device): compute with the WASM kernel. */
export class WebGpuUnavailableError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "WebGpuUnavailableError";
  }
}

/** The device cannot hold what the kernel needs (an expert's matrix, a call's rows). */
export class WebGpuMemoryError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "WebGpuMemoryError";
  }
}

/** The device was lost (the driver reset, the tab in the background too long, `destroy()`): every later call throws this. */
export class WebGpuDeviceLostError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "WebGpuDeviceLostError";
  }
}

// -- the shader ----------------------------------------------------------------------------

/** Tile edge: a workgroup computes a TILE x TILE block of S (TILE rows r by TILE outputs j). */
const TILE = 16;

/**
 * S[r, j] = sum_k W[j, k] X[r, k] for r < n, j < J, over k < K (W [J, K] with rows `stride`
 * values apart, X [n, K], S [n, J], row-major float32): each workgroup stages TILE x TILE tiles of
 * W and X in workgroup memory (zeros past the edges, so any n, J and K), and each invocation sums
 * its (r, j) in float32. `bf16`: W holds bfloat16 values, two to a u32 (the first in the low
 * half), each widened to float32 exactly (its bits shifted up).
 */
export function matvecWgsl(bf16: boolean): string {
  const loadW = bf16
    ? `let i = wj * dims.stride + k;
      let word = W[i >> 1u];
      wv = bitcast<f32>(select(word << 16u, word & 0xffff0000u, (i & 1u) == 1u));`
    : `wv = W[wj * dims.stride + k];`;
  return /* wgsl */ `
struct Dims { n: u32, J: u32, K: u32, stride: u32 }
@group(0) @binding(0) var<storage, read> W: array<${bf16 ? "u32" : "f32"}>;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> S: array<f32>;
@group(0) @binding(3) var<uniform> dims: Dims;

const T: u32 = ${TILE}u;
// One padding column: the rows of a tile fall in different banks.
var<workgroup> tw: array<array<f32, ${TILE + 1}>, ${TILE}>;
var<workgroup> tx: array<array<f32, ${TILE + 1}>, ${TILE}>;

@compute @workgroup_size(${TILE}, ${TILE}, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
  let n = dims.n;
  let J = dims.J;
  let K = dims.K;
  let j0 = wg.x * T;
  let r0 = wg.y * T;
  var acc: f32 = 0.0;
  for (var k0: u32 = 0u; k0 < K; k0 = k0 + T) {
    let k = k0 + lid.x;
    let wj = j0 + lid.y;
    var wv: f32 = 0.0;
    if (wj < J && k < K) {
      ${loadW}
    }
    tw[lid.y][lid.x] = wv;
    let xr = r0 + lid.y;
    var xv: f32 = 0.0;
    if (xr < n && k < K) {
      xv = X[xr * K + k];
    }
    tx[lid.y][lid.x] = xv;
    workgroupBarrier();
    for (var kk: u32 = 0u; kk < T; kk = kk + 1u) {
      acc = acc + tx[lid.y][kk] * tw[lid.x][kk];
    }
    workgroupBarrier();
  }
  let j = j0 + lid.x;
  let r = r0 + lid.y;
  if (r < n && j < J) {
    S[r * J + j] = acc;
  }
}
`;
}

// -- the kernel ----------------------------------------------------------------------------

/** An expert's matrices in GPU buffers. */
interface Placed {
  H: number;
  I: number;
  gu: GpuBuffer;
  d: GpuBuffer;
  /** Held as bfloat16 (every weight was a bfloat16 value), rows padded to an even length; else float32. */
  bf16: boolean;
  bytes: number;
  /** Settles once the device has said whether the buffers were made (an out-of-memory error). */
  ready: Promise<GpuError | null>;
  /** The bind groups of the two passes over the scratch of generation `gen`. */
  gen: number;
  pass1?: GpuBindGroup;
  pass2?: GpuBindGroup;
}

/** The per-call buffers: the rows in (x, then h), the sums out (S1, then S2), a MAP_READ copy. */
interface Scratch {
  inBuf: GpuBuffer;
  outBuf: GpuBuffer;
  staging: GpuBuffer;
  inBytes: number;
  outBytes: number;
  gen: number;
}

export interface WebGpuKernelOptions {
  /** Rows computed per pass (a call of more rows runs in blocks): bounds the scratch buffers. Default 1024. */
  blockRows?: number;
  /** The largest GPU buffer the kernel makes, in bytes (at most the device's maxStorageBufferBindingSize and maxBufferSize). */
  maxBufferBytes?: number;
  /** Passed to requestAdapter. Default "high-performance". */
  powerPreference?: "low-power" | "high-performance";
}

const mib = (bytes: number): string =>
  bytes < 2 ** 20 ? `${(bytes / 1024).toFixed(1)} KiB` : `${(bytes / 2 ** 20).toFixed(1)} MiB`;
const errorText = (exc: unknown): string => (exc instanceof Error ? exc.message : String(exc));

/** The adapter's vendor and architecture (and device, description) in one line, e.g. `google / swiftshader`. */
function describeAdapter(adapter: GpuAdapter): string {
  const info = adapter.info ?? {};
  const parts = [info.vendor, info.architecture, info.device, info.description].filter((p) => p);
  return (parts.length ? parts.join(" / ") : "unnamed adapter") + (isFallback(adapter) ? " (fallback adapter)" : "");
}

function isFallback(adapter: GpuAdapter): boolean {
  return Boolean(adapter.info?.isFallbackAdapter ?? adapter.isFallbackAdapter);
}

export class WebGpuKernel {
  readonly #device: GpuDevice;
  /** The pipelines for float32 weights and for bfloat16 ones, and their bind group layouts. */
  readonly #pipelines: [GpuComputePipeline, GpuComputePipeline];
  readonly #layouts: [GpuBindGroupLayout, GpuBindGroupLayout];
  readonly #dims: GpuBuffer;
  readonly #maxBuffer: number;
  readonly #maxGroups: number;
  readonly #blockRows: number;
  #placed = new WeakMap<ExpertMatrices, Placed>();
  /** The same placed experts, to free their buffers on reset(). */
  #all = new Set<Placed>();
  #held = 0;
  #scratch: Scratch | undefined;
  #gen = 0;
  #lost: string | undefined;
  /** The end of the last call queued: calls share the scratch, so each waits for the one before. */
  #tail: Promise<unknown> = Promise.resolve();
  /** The adapter, in one line (vendor / architecture ...), for the page's status and logs. */
  readonly adapterInfo: string;
  /** Whether the adapter is a fallback one (a software rasterizer such as SwiftShader, on the CPU):
   * there the WASM kernel is much faster (measureKernels in measure.ts). */
  readonly isFallbackAdapter: boolean;

  private constructor(
    device: GpuDevice,
    pipelines: [GpuComputePipeline, GpuComputePipeline],
    adapter: GpuAdapter,
    options: WebGpuKernelOptions,
  ) {
    this.#device = device;
    this.#pipelines = pipelines;
    this.#layouts = [pipelines[0].getBindGroupLayout(0), pipelines[1].getBindGroupLayout(0)];
    this.adapterInfo = describeAdapter(adapter);
    this.isFallbackAdapter = isFallback(adapter);
    const limits = device.limits;
    this.#maxBuffer = Math.min(
      limits.maxStorageBufferBindingSize,
      limits.maxBufferSize,
      options.maxBufferBytes ?? Number.POSITIVE_INFINITY,
    );
    this.#maxGroups = limits.maxComputeWorkgroupsPerDimension;
    this.#blockRows = Math.max(1, Math.floor(options.blockRows ?? 1024));
    this.#dims = device.createBuffer({ size: 16, usage: UNIFORM | COPY_DST, label: "kvasir dims" });
    device.lost.then(
      (info) => {
        this.#lost ??= `${info.reason || "unknown reason"}${info.message ? `: ${info.message}` : ""}`;
      },
      () => undefined,
    );
  }

  /**
   * The kernel on `gpu` (navigator.gpu unless given): an adapter, a device with the adapter's
   * largest buffer limits, the compiled shader. Throws WebGpuUnavailableError when there is no
   * WebGPU, no adapter or no device (the caller then computes with the WASM kernel).
   */
  static async create(gpu?: Gpu, options: WebGpuKernelOptions = {}): Promise<WebGpuKernel> {
    const g = gpu ?? (globalThis as { navigator?: { gpu?: Gpu } }).navigator?.gpu;
    if (!g) {
      throw new WebGpuUnavailableError(
        "WebGPU is not available here: no navigator.gpu (a browser without WebGPU, WebGPU turned off, or a page " +
          "that is not a secure context)",
      );
    }
    let adapter: GpuAdapter | null;
    try {
      adapter = await g.requestAdapter({ powerPreference: options.powerPreference ?? "high-performance" });
    } catch (exc) {
      throw new WebGpuUnavailableError(`WebGPU is not available here: requestAdapter failed: ${errorText(exc)}`);
    }
    if (!adapter) {
      throw new WebGpuUnavailableError(
        "WebGPU is not available here: navigator.gpu.requestAdapter() gave no adapter (no usable GPU, or the browser " +
          "blocks this one)",
      );
    }
    const info = describeAdapter(adapter);
    let device: GpuDevice;
    try {
      // The adapter's largest buffers, so that the largest experts fit.
      device = await adapter.requestDevice({
        requiredLimits: {
          maxStorageBufferBindingSize: adapter.limits.maxStorageBufferBindingSize,
          maxBufferSize: adapter.limits.maxBufferSize,
        },
        label: "kvasir expert kernel",
      });
    } catch (exc) {
      throw new WebGpuUnavailableError(`WebGPU is not available here: the adapter (${info}) gave no device: ${errorText(exc)}`);
    }
    try {
      const pipeline = (bf16: boolean): Promise<GpuComputePipeline> => {
        const label = `kvasir matvec (${bf16 ? "bfloat16" : "float32"} weights)`;
        const module = device.createShaderModule({ code: matvecWgsl(bf16), label });
        return device.createComputePipelineAsync({ layout: "auto", compute: { module, entryPoint: "main" }, label });
      };
      const pipelines = await Promise.all([pipeline(false), pipeline(true)]);
      return new WebGpuKernel(device, pipelines, adapter, options);
    } catch (exc) {
      device.destroy();
      throw new WebGpuUnavailableError(`the WebGPU expert kernel does not compile on ${info}: ${errorText(exc)}`);
    }
  }

  /** Bytes of expert matrices held in GPU buffers. */
  get placedBytes(): number {
    return this.#held;
  }

  /** The largest buffer the kernel makes, in bytes (the device's limits, or the option's). */
  get maxBufferBytes(): number {
    return this.#maxBuffer;
  }

  /** Why the device is gone, or undefined while it works. */
  get lost(): string | undefined {
    return this.#lost;
  }

  /** Free the device and everything on it; later calls throw WebGpuDeviceLostError. */
  destroy(): void {
    this.#lost ??= "destroyed: the kernel was destroyed";
    this.#device.destroy();
  }

  /** Forget every placed expert, freeing their buffers. */
  reset(): void {
    const old = [...this.#all];
    this.#placed = new WeakMap();
    this.#all = new Set();
    this.#held = 0;
    // Freed once the calls queued now (which may use them) are done.
    this.#tail = this.#tail.then(() => {
      for (const p of old) {
        p.gu.destroy();
        p.d.destroy();
      }
    });
  }

  /**
   * Upload `m`'s GU and D into GPU buffers, unless they are there already; WebGpuMemoryError when
   * one is larger than the device's largest buffer. (An allocation the device refuses later
   * surfaces as WebGpuMemoryError from the expert's first call.)
   */
  place(m: ExpertMatrices): void {
    this.#check();
    if (this.#placed.has(m)) return;
    const { H, I } = m;
    if (m.GU.length !== 2 * I * H || m.D.length !== H * I) {
      throw new Error(`expert matrices of ${m.GU.length} and ${m.D.length} values, expected ${2 * I * H} and ${H * I}`);
    }
    // bfloat16 weights (a bfloat16 model's) are held as 16 bits: half the memory and the reads.
    const bf16 = allBf16(m.GU) && allBf16(m.D);
    const guBytes = bf16 ? 2 * I * pad2(H) * 2 : 2 * I * H * 4;
    const dBytes = bf16 ? H * pad2(I) * 2 : H * I * 4;
    const largest = Math.max(guBytes, dBytes);
    if (largest > this.#maxBuffer) {
      throw new WebGpuMemoryError(
        `the WebGPU kernel cannot hold expert [H ${H}, I ${I}]: its gate_up matrix is ${mib(guBytes)}, ` +
          `larger than the device's largest buffer (${mib(this.#maxBuffer)}, ${this.adapterInfo})`,
      );
    }
    const device = this.#device;
    device.pushErrorScope("out-of-memory");
    device.pushErrorScope("validation");
    const upload = (values: Float32Array, rows: number, cols: number, label: string): GpuBuffer => {
      const size = bf16 ? rows * pad2(cols) * 2 : values.byteLength;
      const b = device.createBuffer({ size, usage: STORAGE | COPY_DST, mappedAtCreation: true, label });
      if (bf16) copyRowsBf16(new Uint16Array(b.getMappedRange()), values, rows, cols, pad2(cols));
      else new Float32Array(b.getMappedRange()).set(values);
      b.unmap();
      return b;
    };
    let gu: GpuBuffer | undefined;
    let d: GpuBuffer;
    let validation: Promise<GpuError | null>;
    let oom: Promise<GpuError | null>;
    try {
      gu = upload(m.GU, 2 * I, H, "kvasir GU");
      d = upload(m.D, H, I, "kvasir D");
    } catch (exc) {
      // A mapped buffer the browser cannot allocate throws a RangeError at once.
      gu?.destroy();
      throw new WebGpuMemoryError(
        `the WebGPU kernel cannot hold expert [H ${H}, I ${I}] (${mib(guBytes + dBytes)}; ${mib(this.#held)} of ` +
          `experts placed already): ${errorText(exc)}`,
      );
    } finally {
      validation = device.popErrorScope();
      oom = device.popErrorScope();
    }
    const ready = Promise.all([oom, validation]).then(
      ([a, b]) => a ?? b,
      (exc: unknown) => ({ message: errorText(exc) }),
    );
    const p: Placed = { H, I, gu, d, bf16, bytes: guBytes + dBytes, ready, gen: -1 };
    this.#placed.set(m, p);
    this.#all.add(p);
    this.#held += p.bytes;
  }

  /**
   * One expert over `n` rows, as expert.ts's jsExpertForward: `rows` [n, H] (values of the
   * compute dtype), `weights` [n] (values of `weightsDType`); `m`'s matrices are placed on first use.
   */
  async expertForward(
    fn: ExpertFunction,
    dtype: FloatDType,
    m: ExpertMatrices,
    rows: Float32Array,
    weights: ArrayLike<number>,
    weightsDType: FloatDType,
  ): Promise<ExpertResult> {
    const { H, I } = m;
    const n = weights.length;
    if (rows.length !== n * H) throw new Error(`expertForward: ${rows.length} values for ${n} rows of ${H}`);
    const steps = expertSteps(fn, dtype, m, weightsDType); // refuses a function it does not compute
    const proj = new Float32Array(n * 2 * I);
    const out = new Float64Array(n * H);
    if (n === 0) return { out, outDType: steps.outDType, proj };
    this.place(m);
    const p = this.#placed.get(m)!;
    // One call at a time: each waits for the calls queued before it (their failures are theirs).
    const run = this.#tail.then(() => this.#run(p, m, rows, weights, steps, proj, out));
    this.#tail = run.catch(() => undefined);
    await run;
    return { out, outDType: steps.outDType, proj };
  }

  async #run(
    p: Placed,
    m: ExpertMatrices,
    rows: Float32Array,
    weights: ArrayLike<number>,
    steps: ExpertSteps,
    proj: Float32Array,
    out: Float64Array,
  ): Promise<void> {
    this.#check();
    const failed = await p.ready;
    if (failed) {
      if (this.#all.delete(p)) {
        if (this.#placed.get(m) === p) this.#placed.delete(m);
        this.#held -= p.bytes;
      }
      p.gu.destroy();
      p.d.destroy();
      throw new WebGpuMemoryError(
        `the WebGPU kernel cannot hold expert [H ${p.H}, I ${p.I}] (${mib(p.bytes)}; ${mib(this.#held)} of experts ` +
          `placed already): ${failed.message}`,
      );
    }
    const { H, I } = p;
    const n = weights.length;
    const J = 2 * I;
    const wide = Math.max(J, H);
    // Rows per block: the option's, and what the largest buffer and the workgroup grid allow.
    const block = Math.max(
      1,
      Math.min(n, this.#blockRows, Math.floor(this.#maxBuffer / (wide * 4)), this.#maxGroups * TILE),
    );
    if (Math.ceil(wide / TILE) > this.#maxGroups) {
      throw new WebGpuMemoryError(`the WebGPU kernel cannot compute expert [H ${H}, I ${I}]: ${wide} outputs of a pass ` +
        `need more than the device's ${this.#maxGroups} workgroups`);
    }
    const s = await this.#ensureScratch(block * Math.max(H, I) * 4, block * wide * 4, H, I);
    if (p.gen !== s.gen || !p.pass1 || !p.pass2) {
      const group = (w: GpuBuffer): GpuBindGroup =>
        this.#device.createBindGroup({
          layout: this.#layouts[p.bf16 ? 1 : 0],
          entries: [
            { binding: 0, resource: { buffer: w } },
            { binding: 1, resource: { buffer: s.inBuf } },
            { binding: 2, resource: { buffer: s.outBuf } },
            { binding: 3, resource: { buffer: this.#dims } },
          ],
        });
      p.pass1 = group(p.gu);
      p.pass2 = group(p.d);
      p.gen = s.gen;
    }
    const h = new Float32Array(block * I);
    const dims = new Uint32Array(4);
    for (let r0 = 0; r0 < n; r0 += block) {
      const b = Math.min(block, n - r0);
      // Pass 1: the sums of gate and up; each rounded once and its bias added here (expertSteps).
      this.#device.queue.writeBuffer(s.inBuf, 0, rows, r0 * H, b * H);
      const s1 = await this.#pass(s, p, p.pass1, dims, b, J, H);
      const pBase = r0 * J;
      for (let r = 0; r < b; r++) {
        const o = r * J;
        for (let j = 0; j < J; j++) proj[pBase + o + j] = steps.proj(s1[o + j]!, j);
      }
      s.staging.unmap();
      // The gate, row by row, each step rounded: h [b, I].
      for (let r = 0; r < b; r++) steps.gate(proj, pBase + r * J, h, r * I);
      // Pass 2: the sums of down; rounded, its bias added, times the routing weight (expertSteps).
      this.#device.queue.writeBuffer(s.inBuf, 0, h, 0, b * I);
      const s2 = await this.#pass(s, p, p.pass2, dims, b, H, I);
      for (let r = 0; r < b; r++) {
        const w = weights[r0 + r]!;
        const o = r * H;
        const dst = (r0 + r) * H;
        for (let i = 0; i < H; i++) out[dst + i] = steps.out(s2[o + i]!, i, w);
      }
      s.staging.unmap();
    }
  }

  /** One pass over `b` rows (S [b, J] from W [J, K] and the rows in s.inBuf), its sums mapped for
   * reading in s.staging (the caller unmaps it). */
  async #pass(
    s: Scratch,
    p: Placed,
    group: GpuBindGroup,
    dims: Uint32Array,
    b: number,
    J: number,
    K: number,
  ): Promise<Float32Array> {
    const device = this.#device;
    dims[0] = b;
    dims[1] = J;
    dims[2] = K;
    dims[3] = p.bf16 ? pad2(K) : K; // W's row stride, in values
    device.queue.writeBuffer(this.#dims, 0, dims);
    const bytes = b * J * 4;
    device.pushErrorScope("validation");
    const enc = device.createCommandEncoder();
    const pass = enc.beginComputePass({ label: "kvasir matvec" });
    pass.setPipeline(this.#pipelines[p.bf16 ? 1 : 0]);
    pass.setBindGroup(0, group);
    pass.dispatchWorkgroups(Math.ceil(J / TILE), Math.ceil(b / TILE), 1);
    pass.end();
    enc.copyBufferToBuffer(s.outBuf, 0, s.staging, 0, bytes);
    device.queue.submit([enc.finish()]);
    const invalid = device.popErrorScope();
    try {
      const err = await invalid;
      if (err) throw new Error(`the WebGPU kernel's pass failed: ${err.message}`);
      await s.staging.mapAsync(MAP_MODE_READ, 0, bytes);
    } catch (exc) {
      // A lost device rejects mapAsync: say so when device.lost has settled by now.
      await Promise.race([this.#device.lost.then((info) => (this.#lost ??= info.reason || "lost")), Promise.resolve()]);
      this.#check();
      throw exc;
    }
    this.#check();
    return new Float32Array(s.staging.getMappedRange(0, bytes));
  }

  /** The scratch, grown to at least these sizes (a new generation: the bind groups are remade). */
  async #ensureScratch(inBytes: number, outBytes: number, H: number, I: number): Promise<Scratch> {
    const have = this.#scratch;
    if (have && have.inBytes >= inBytes && have.outBytes >= outBytes) return have;
    // Grown geometrically (at most to the largest buffer), so that calls of growing size do not remake it each time.
    const grow = (want: number, had: number): number =>
      Math.min(this.#maxBuffer, Math.max(want, Math.ceil((had * 3) / 2 / 16) * 16));
    const inSize = grow(inBytes, have?.inBytes ?? 0);
    const outSize = grow(outBytes, have?.outBytes ?? 0);
    const device = this.#device;
    device.pushErrorScope("out-of-memory");
    const made: Scratch = {
      inBuf: device.createBuffer({ size: inSize, usage: STORAGE | COPY_DST, label: "kvasir rows" }),
      outBuf: device.createBuffer({ size: outSize, usage: STORAGE | COPY_SRC, label: "kvasir sums" }),
      staging: device.createBuffer({ size: outSize, usage: MAP_READ | COPY_DST, label: "kvasir readback" }),
      inBytes: inSize,
      outBytes: outSize,
      gen: ++this.#gen,
    };
    const err = await device.popErrorScope();
    if (err) {
      made.inBuf.destroy();
      made.outBuf.destroy();
      made.staging.destroy();
      throw new WebGpuMemoryError(
        `the WebGPU kernel cannot make the scratch of a call of expert [H ${H}, I ${I}] (${mib(inSize + 2 * outSize)}): ` +
          err.message,
      );
    }
    if (have) {
      have.inBuf.destroy();
      have.outBuf.destroy();
      have.staging.destroy();
    }
    this.#scratch = made;
    return made;
  }

  /** Throw WebGpuDeviceLostError once the device is gone. */
  #check(): void {
    if (this.#lost !== undefined) {
      throw new WebGpuDeviceLostError(
        `the WebGPU device was lost (${this.#lost}); compute with the WASM or JavaScript kernel`,
      );
    }
  }
}

const pad2 = (n: number): number => n + (n & 1);

/** Whether every value of `a` is a bfloat16 value (the low 16 bits of its float32 bits zero). */
function allBf16(a: Float32Array): boolean {
  const u = new Uint32Array(a.buffer, a.byteOffset, a.length);
  for (let i = 0; i < u.length; i++) if (u[i]! & 0xffff) return false;
  return true;
}

/** The rows [rows, cols] of `src` (bfloat16 values) into `dst` [rows, stride] as bfloat16 bits,
 * each row padded with zeros (exact: the values are bfloat16 values). */
function copyRowsBf16(dst: Uint16Array, src: Float32Array, rows: number, cols: number, stride: number): void {
  const bits = new Uint32Array(src.buffer, src.byteOffset, src.length);
  for (let r = 0; r < rows; r++) {
    const a = r * cols;
    const d = r * stride;
    for (let k = 0; k < cols; k++) dst[d + k] = bits[a + k]! >>> 16;
    if (stride > cols) dst.fill(0, d + cols, d + stride);
  }
}

/** The kernel as an ExpertKernel (src/worker/expert.ts's useExpertKernel): its results are promises. */
export function webgpuExpertForward(kernel: WebGpuKernel): ExpertKernel {
  return kernel.expertForward.bind(kernel);
}
