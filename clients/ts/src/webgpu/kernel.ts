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
// with one of two shaders, by the call's row count n: up to SMALL_ROWS (8) rows (a decode step's
// 1 to a few rows per expert) matvecSmallWgsl, a workgroup of 64 invocations per 8 outputs (8
// lanes each) that reads W's rows once for all n rows (vec4 loads where K allows) and sums in a tree in workgroup
// memory; more rows matvecWgsl, 16 x 16 tiles of S (which at n = 1 leave 15/16 of the
// invocations idle).
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
interface GpuPipelineLayout {
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
  createBindGroupLayout(descriptor: {
    entries: { binding: number; visibility: number; buffer: { type: "uniform" | "storage" | "read-only-storage" } }[];
    label?: string;
  }): GpuBindGroupLayout;
  createPipelineLayout(descriptor: { bindGroupLayouts: GpuBindGroupLayout[]; label?: string }): GpuPipelineLayout;
  createComputePipelineAsync(descriptor: {
    layout: GpuPipelineLayout | "auto";
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
const SHADER_STAGE_COMPUTE = 0x4;

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

/** The most rows the small-batch shader computes in one pass (its accumulators per invocation). */
export const SMALL_ROWS = 8;
/** Invocations per workgroup of the small-batch shader. */
const SMALL_GROUP = 64;
/** Outputs j per workgroup of the small-batch shader (its 64 invocations split among them, 8
 * lanes each: 128 contiguous bytes of a row per vec4 load). On SwiftShader, where a workgroup and
 * a barrier cost much, 1 output gave 4.7 rows/s at n = 1 (H 2048, I 768), 8 outputs 15.8, 16
 * outputs 19.4, 64 (one per invocation) 22.8; 8 keeps a GPU's reads in whole 128-byte lines. */
const SMALL_OUTPUTS = 8;

/** How the small-batch shader reads W and X: one value at a time (any K), four float32 values
 * (K a multiple of 4), one u32 of two bfloat16 values (any K), or a vec4<u32> of eight (K a
 * multiple of 8). */
export type SmallLoad = "f32" | "f32x4" | "bf16x2" | "bf16x8";

/** The small-batch shader's load for W of `bf16` weights and rows of K values. */
export function smallLoad(bf16: boolean, K: number): SmallLoad {
  return bf16 ? (K % 8 === 0 ? "bf16x8" : "bf16x2") : K % 4 === 0 ? "f32x4" : "f32";
}

/**
 * The small-batch matrix-vector shader, for n <= SMALL_ROWS rows (a decode step's 1 to a few
 * rows per expert), where matvecWgsl's 16 x 16 tiles would leave most invocations idle: the same
 * S[r, j] = sum_k W[j, k] X[r, k] (W [J, K] with rows `stride` values apart, X [n, K], S [n, J]).
 *
 * Each workgroup of SMALL_GROUP (64) invocations computes `outputs` consecutive outputs j, `lanes`
 * = 64 / outputs invocations each (default SMALL_OUTPUTS, 8 outputs of 8 lanes): the lanes
 * stride over k, lane l reading W[j, l], W[j, l + lanes], ... (with `load` "f32x4" / "bf16x8", a
 * vec4 of 4 float32 / 8 bfloat16 values a lane: consecutive lanes read consecutive 16 bytes, so
 * 8 lanes read a 128-byte line of W's row), and accumulate every row r < n in registers in the same
 * loop (W is read once for all n rows); then a tree reduction over the lanes in workgroup memory
 * (log2(lanes) steps), and lanes t < n * outputs write the sums. Float32 throughout. The workgroups form
 * a 2-D grid (j = (wg.x + wg.y * num_workgroups.x) * outputs + o): J may exceed the device's
 * maxComputeWorkgroupsPerDimension. Any J, K.
 */
export function matvecSmallWgsl(load: SmallLoad, outputs = SMALL_OUTPUTS): string {
  if (!(Number.isInteger(outputs) && outputs >= 1 && SMALL_GROUP % outputs === 0)) {
    throw new Error(`matvecSmallWgsl: ${outputs} outputs per workgroup do not divide ${SMALL_GROUP} invocations`);
  }
  const lanes = SMALL_GROUP / outputs;
  const R = SMALL_ROWS;
  const rows = Array.from({ length: R }, (_, r) => r);
  const decl = rows.map((r) => `var a${r}: f32 = 0.0;`).join("\n  ");
  // One W load (w) and, for each row r < n, its products with the matching X values added to a<r>.
  const each = (body: (r: number) => string): string =>
    rows.map((r) => `if (n > ${r}u) { ${body(r)} }`).join("\n      ");
  let wType: string;
  let xType: string;
  let loop: string;
  switch (load) {
    case "f32":
      wType = "f32";
      xType = "f32";
      loop = `let wrow = j * dims.stride;
    for (var k: u32 = l; k < K; k = k + L) {
      let w = W[wrow + k];
      ${each((r) => `a${r} = a${r} + w * X[${r}u * K + k];`)}
    }`;
      break;
    case "f32x4":
      wType = "vec4<f32>";
      xType = "vec4<f32>";
      loop = `let K4 = K >> 2u;
    let wrow = j * (dims.stride >> 2u);
    for (var q: u32 = l; q < K4; q = q + L) {
      let w = W[wrow + q];
      ${each((r) => `a${r} = a${r} + dot(w, X[${r}u * K4 + q]);`)}
    }`;
      break;
    case "bf16x2":
      // A u32 holds W[j, 2q] (low half) and W[j, 2q + 1] (high half); an odd K's last value
      // (with a zero beside it in the row's padding) by lane 0 after the loop.
      wType = "u32";
      xType = "f32";
      loop = `let wrow = j * (dims.stride >> 1u);
    let K2 = K >> 1u;
    for (var q: u32 = l; q < K2; q = q + L) {
      let word = W[wrow + q];
      let w0 = bitcast<f32>(word << 16u);
      let w1 = bitcast<f32>(word & 0xffff0000u);
      let k = q << 1u;
      ${each((r) => `a${r} = a${r} + w0 * X[${r}u * K + k] + w1 * X[${r}u * K + k + 1u];`)}
    }
    if ((K & 1u) == 1u && l == 0u) {
      let w = bitcast<f32>(W[wrow + K2] << 16u);
      let k = K - 1u;
      ${each((r) => `a${r} = a${r} + w * X[${r}u * K + k];`)}
    }`;
      break;
    case "bf16x8":
      // A vec4<u32> holds W[j, 8q .. 8q + 7]: the low halves are the even k, the high halves the odd.
      wType = "vec4<u32>";
      xType = "vec4<f32>";
      loop = `let K4 = K >> 2u;
    let wrow = j * (dims.stride >> 3u);
    for (var q: u32 = l; q < (K >> 3u); q = q + L) {
      let word = W[wrow + q];
      let we = bitcast<vec4<f32>>(word << vec4<u32>(16u));
      let wo = bitcast<vec4<f32>>(word & vec4<u32>(0xffff0000u));
      ${each(
        (r) => `let xa = X[${r}u * K4 + 2u * q]; let xb = X[${r}u * K4 + 2u * q + 1u];
        a${r} = a${r} + dot(we, vec4<f32>(xa.x, xa.z, xb.x, xb.z)) + dot(wo, vec4<f32>(xa.y, xa.w, xb.y, xb.w));`,
      )}
    }`;
      break;
  }
  const store = rows.map((r) => `if (n > ${r}u) { part[${r}u * G + t] = a${r}; }`).join("\n  ");
  return /* wgsl */ `
struct Dims { n: u32, J: u32, K: u32, stride: u32 }
@group(0) @binding(0) var<storage, read> W: array<${wType}>;
@group(0) @binding(1) var<storage, read> X: array<${xType}>;
@group(0) @binding(2) var<storage, read_write> S: array<f32>;
@group(0) @binding(3) var<uniform> dims: Dims;

const G: u32 = ${SMALL_GROUP}u; // invocations per workgroup
const L: u32 = ${lanes}u;       // lanes per output
const O: u32 = ${outputs}u;     // outputs per workgroup
// Each lane's partial sum of each row: row r's at [r * G + t], consecutive lanes consecutive words.
var<workgroup> part: array<f32, ${R * SMALL_GROUP}>;

@compute @workgroup_size(${SMALL_GROUP}, 1, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) ng: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {
  let n = min(dims.n, ${R}u);
  let J = dims.J;
  let K = dims.K;
  let j0 = (wg.x + wg.y * ng.x) * O;
  let o = t / L;
  let l = t % L;
  let j = j0 + o;
  ${decl}
  if (j < J) {
    ${loop}
  }
  ${store}
  workgroupBarrier();
  for (var s: u32 = L >> 1u; s > 0u; s = s >> 1u) {
    if (l < s) {
      for (var r: u32 = 0u; r < n; r = r + 1u) {
        part[r * G + t] = part[r * G + t] + part[r * G + t + s];
      }
    }
    workgroupBarrier();
  }
  // Lane t < n * O writes row t / O of output j0 + t % O (consecutive lanes, consecutive j).
  if (t < n * O) {
    let r = t / O;
    let jj = j0 + t % O;
    if (jj < J) {
      S[r * J + jj] = part[r * G + (t % O) * L];
    }
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
  /** Calls of at most this many rows use the small-batch shader (matvecSmallWgsl), larger ones the
   * tiled one (matvecWgsl); 0 to use the tiled one always. Default (and at most) SMALL_ROWS, 8. */
  smallRows?: number;
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

/** The compiled shaders: the tiled one for float32 and for bfloat16 weights, the small-batch one for each of its loads. */
interface Pipelines {
  tiled: [GpuComputePipeline, GpuComputePipeline];
  small: Record<SmallLoad, GpuComputePipeline>;
}
const SMALL_LOADS: SmallLoad[] = ["f32", "f32x4", "bf16x2", "bf16x8"];

export class WebGpuKernel {
  readonly #device: GpuDevice;
  readonly #pipelines: Pipelines;
  /** The one bind group layout every pipeline shares (W, X, S, dims). */
  readonly #layout: GpuBindGroupLayout;
  readonly #smallRows: number;
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
    pipelines: Pipelines,
    layout: GpuBindGroupLayout,
    adapter: GpuAdapter,
    options: WebGpuKernelOptions,
  ) {
    this.#device = device;
    this.#pipelines = pipelines;
    this.#layout = layout;
    this.#smallRows = Math.max(0, Math.min(SMALL_ROWS, Math.floor(options.smallRows ?? SMALL_ROWS)));
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
      // One layout for every pipeline, so that an expert's bind groups serve both shaders.
      const layout = device.createBindGroupLayout({
        entries: [
          { binding: 0, visibility: SHADER_STAGE_COMPUTE, buffer: { type: "read-only-storage" } },
          { binding: 1, visibility: SHADER_STAGE_COMPUTE, buffer: { type: "read-only-storage" } },
          { binding: 2, visibility: SHADER_STAGE_COMPUTE, buffer: { type: "storage" } },
          { binding: 3, visibility: SHADER_STAGE_COMPUTE, buffer: { type: "uniform" } },
        ],
        label: "kvasir matvec bindings",
      });
      const pipelineLayout = device.createPipelineLayout({ bindGroupLayouts: [layout], label: "kvasir matvec" });
      const pipeline = (code: string, label: string): Promise<GpuComputePipeline> => {
        const module = device.createShaderModule({ code, label });
        return device.createComputePipelineAsync({ layout: pipelineLayout, compute: { module, entryPoint: "main" }, label });
      };
      const [tiled, small] = await Promise.all([
        Promise.all([false, true].map((bf16) =>
          pipeline(matvecWgsl(bf16), `kvasir matvec (${bf16 ? "bfloat16" : "float32"} weights)`))),
        Promise.all(SMALL_LOADS.map((load) => pipeline(matvecSmallWgsl(load), `kvasir small-batch matvec (${load})`))),
      ]);
      const pipelines: Pipelines = {
        tiled: [tiled[0]!, tiled[1]!],
        small: Object.fromEntries(SMALL_LOADS.map((load, i) => [load, small[i]!])) as Record<SmallLoad, GpuComputePipeline>,
      };
      return new WebGpuKernel(device, pipelines, layout, adapter, options);
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
    // The shader, by the call's row count (so a row's sums do not depend on the block it falls
    // in): the small-batch one up to smallRows rows, else the tiled one; and the small-batch one
    // in blocks of SMALL_ROWS where the tiled one's grid would be too wide (its 2-D grid is not).
    const tooWide = Math.ceil(wide / TILE) > this.#maxGroups;
    const small = n <= this.#smallRows || tooWide;
    // Rows per block: the option's, and what the largest buffer and the workgroup grid allow.
    const block = Math.max(
      1,
      Math.min(n, this.#blockRows, Math.floor(this.#maxBuffer / (wide * 4)), small ? SMALL_ROWS : this.#maxGroups * TILE),
    );
    const s = await this.#ensureScratch(block * Math.max(H, I) * 4, block * wide * 4, H, I);
    if (p.gen !== s.gen || !p.pass1 || !p.pass2) {
      const group = (w: GpuBuffer): GpuBindGroup =>
        this.#device.createBindGroup({
          layout: this.#layout,
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
      const s1 = await this.#pass(s, p, p.pass1, dims, small, b, J, H);
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
      const s2 = await this.#pass(s, p, p.pass2, dims, small, b, H, I);
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
   * reading in s.staging (the caller unmaps it); `small`: with the small-batch shader (b <= SMALL_ROWS). */
  async #pass(
    s: Scratch,
    p: Placed,
    group: GpuBindGroup,
    dims: Uint32Array,
    small: boolean,
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
    pass.setBindGroup(0, group);
    if (small) {
      // A workgroup per SMALL_OUTPUTS outputs, in a 2-D grid no wider than the device allows.
      pass.setPipeline(this.#pipelines.small[smallLoad(p.bf16, K)]);
      const groups = Math.ceil(J / SMALL_OUTPUTS);
      const x = Math.min(groups, this.#maxGroups);
      pass.dispatchWorkgroups(x, Math.ceil(groups / x), 1);
    } else {
      pass.setPipeline(this.#pipelines.tiled[p.bf16 ? 1 : 0]);
      pass.dispatchWorkgroups(Math.ceil(J / TILE), Math.ceil(b / TILE), 1);
    }
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
