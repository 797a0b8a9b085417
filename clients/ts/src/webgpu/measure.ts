// Rows per second of one expert by each kernel a page can use: JavaScript (expert.ts's
// jsExpertForward), WebAssembly SIMD (src/wasm/kernel.ts) and WebGPU (kernel.ts here). Not a
// test: a measurement for a page (tools/measure_workers.py may call it). Browser-safe.
//
// From a page whose bundle exports it (or a test bundle of this module), e.g. over the DevTools
// protocol's Runtime.evaluate with awaitPromise:
//
//   const { measureKernels } = await import("/path/to/bundle.js");
//   await measureKernels({ H: 512, I: 256, n: 64, seconds: 1 });
//   // -> { H: 512, I: 256, n: 64, dtype: "float32",
//   //      rowsPerSecond: { js: 1600, wasm: 36000, webgpu: 9000 },
//   //      adapter: "google / swiftshader", errors: {} }
//
// Chromium gives WebGPU to a headless page with --enable-unsafe-webgpu (SwiftShader, a CPU
// Vulkan, where there is no GPU). A kernel that cannot run here is left out of rowsPerSecond and
// its reason is in errors (no WebGPU adapter, no kernel.wasm beside the bundle).

import type { FloatDType } from "../worker/dtype.js";
import { defaultFunction, jsExpertForward, type ExpertMatrices } from "../worker/expert.js";
import { WasmKernel } from "../wasm/kernel.js";
import { WebGpuKernel, type Gpu, type WebGpuKernelOptions } from "./kernel.js";
import { prng, randomValues } from "../worker/seeded.js";

export interface MeasureOptions {
  H?: number;
  I?: number;
  /** Rows per call. */
  n?: number;
  dtype?: FloatDType;
  /** Each of three windows lasts at least this long (and 2 calls); the best window counts. */
  seconds?: number;
  /** kernel.wasm's bytes, a Response, or its URL (default: beside the WASM kernel's module, as WasmKernel.load() fetches it). */
  wasm?: ArrayBuffer | Uint8Array | string;
  /** A WebGPU kernel already made (default: WebGpuKernel.create(gpu, webgpuOptions)). */
  webgpu?: WebGpuKernel;
  /** The options of the WebGPU kernel made here, e.g. `{ smallRows: 0 }` for the tiled shader at every row count. */
  webgpuOptions?: WebGpuKernelOptions;
  gpu?: Gpu;
  /** Which kernels (default all three). */
  kernels?: ("js" | "wasm" | "webgpu")[];
}

export interface Measurement {
  H: number;
  I: number;
  n: number;
  dtype: FloatDType;
  rowsPerSecond: { js?: number; wasm?: number; webgpu?: number };
  /** The WebGPU adapter measured, when there was one. */
  adapter?: string;
  /** Why a kernel was not measured. */
  errors: { js?: string; wasm?: string; webgpu?: string };
}

declare const fetch: (url: string) => Promise<{ ok: boolean; status: number; arrayBuffer(): Promise<ArrayBuffer> }>;

/** Calls per second of `run`: the best of three windows of at least `seconds` (and 2 calls) each,
 * after a warm-up call (the best: other work shares the machine). */
async function rate(run: () => unknown, seconds: number): Promise<number> {
  await run();
  let best = 0;
  for (let window = 0; window < 3; window++) {
    let calls = 0;
    const start = performance.now();
    let elapsed = 0;
    while (calls < 2 || elapsed < seconds * 1000) {
      await run();
      calls++;
      elapsed = performance.now() - start;
    }
    best = Math.max(best, (calls * 1000) / elapsed);
  }
  return best;
}


/** Rows per second of one expert (a GLU with silu, random weights) at `n` rows per call, by each kernel. */
export async function measureKernels(options: MeasureOptions = {}): Promise<Measurement> {
  const { H = 64, I = 32, n = 64, dtype = "float32", seconds = 1 } = options;
  const kernels = options.kernels ?? ["js", "wasm", "webgpu"];
  const rand = prng(7);
  const random = (len: number, scale: number): Float32Array => randomValues(rand, len, scale, dtype);
  const m: ExpertMatrices = { H, I, GU: random(2 * I * H, Math.sqrt(3 / H)), D: random(H * I, Math.sqrt(3 / I)) };
  const rows = random(n * H, 1);
  const w = random(n, 1);
  const fn = defaultFunction("silu");
  const result: Measurement = { H, I, n, dtype, rowsPerSecond: {}, errors: {} };
  const why = (exc: unknown): string => (exc instanceof Error ? exc.message : String(exc));
  if (kernels.includes("js")) {
    result.rowsPerSecond.js = n * (await rate(() => jsExpertForward(fn, dtype, m, rows, w, dtype), seconds));
  }
  if (kernels.includes("wasm")) {
    try {
      const src = options.wasm;
      let k: WasmKernel;
      if (typeof src === "string") {
        const res = await fetch(src);
        if (!res.ok) throw new Error(`fetching ${src}: HTTP ${res.status}`);
        k = await WasmKernel.load(await res.arrayBuffer());
      } else {
        k = await WasmKernel.load(src);
      }
      k.place(m);
      result.rowsPerSecond.wasm = n * (await rate(() => k.expertForward(fn, dtype, m, rows, w, dtype), seconds));
    } catch (exc) {
      result.errors.wasm = why(exc);
    }
  }
  if (kernels.includes("webgpu")) {
    let made: WebGpuKernel | undefined;
    try {
      const k = options.webgpu ?? (made = await WebGpuKernel.create(options.gpu, options.webgpuOptions));
      result.adapter = k.adapterInfo;
      k.place(m);
      result.rowsPerSecond.webgpu = n * (await rate(() => k.expertForward(fn, dtype, m, rows, w, dtype), seconds));
    } catch (exc) {
      result.errors.webgpu = why(exc);
    } finally {
      made?.destroy();
    }
  }
  return result;
}
