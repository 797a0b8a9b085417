// Rows per second of one expert: the WASM-SIMD kernel (src/wasm/) against the JS kernel
// (src/worker/expert.ts). Not a test. From clients/ts:
//
//   node --import tsx bench/wasm_kernel.ts [H I]        (default: hidden 2048, intermediate 768)
import { readFileSync } from "node:fs";
import { join } from "node:path";

import { rounder, type FloatDType } from "../src/worker/dtype.js";
import { defaultFunction, jsExpertForward, type ExpertMatrices } from "../src/worker/expert.js";
import { WasmKernel } from "../src/wasm/kernel.js";

const H = Number(process.argv[2] ?? 2048);
const I = Number(process.argv[3] ?? 768);
const fn = defaultFunction("silu");

function random(len: number, scale: number, dtype: FloatDType): Float32Array {
  const r = rounder(dtype);
  return Float32Array.from({ length: len }, () => r((2 * Math.random() - 1) * scale));
}

/** Calls per second of `run`: the best of three windows of at least `seconds` (and 2 calls)
 * each, after a warm-up call (the best, as other processes share the machine's cores). */
function rate(run: () => void, seconds: number): number {
  run();
  let best = 0;
  for (let window = 0; window < 3; window++) {
    let calls = 0;
    const start = performance.now();
    let elapsed = 0;
    while (calls < 2 || elapsed < seconds * 1000) {
      run();
      calls++;
      elapsed = performance.now() - start;
    }
    best = Math.max(best, (calls * 1000) / elapsed);
  }
  return best;
}

const kernel = await WasmKernel.load(readFileSync(join(import.meta.dirname, "..", "src", "wasm", "kernel.wasm")));
const MiB = (bytes: number): string => `${(bytes / 2 ** 20).toFixed(1)} MiB`;
console.log(`one expert, GLU with silu, H ${H}, I ${I} (${MiB(3 * H * I * 4)} of float32 weights)`);
console.log("dtype     rows   JS rows/s   WASM rows/s   speed-up");
for (const dtype of ["float32", "bfloat16"] as FloatDType[]) {
  const GU = random(2 * I * H, Math.sqrt(3 / H), dtype);
  const m: ExpertMatrices = { H, I, GU, D: random(H * I, Math.sqrt(3 / I), dtype) };
  kernel.place(m); // bfloat16 weights are held as 16 bits
  for (const n of [1, 64]) {
    const rows = random(n * H, 1, dtype);
    const w = random(n, 1, dtype);
    const js = n * rate(() => jsExpertForward(fn, dtype, m, rows, w, dtype), n === 1 ? 0.5 : 1);
    const wasm = n * rate(() => kernel.expertForward(fn, dtype, m, rows, w, dtype), 1);
    const f = (x: number): string => x.toFixed(x < 100 ? 1 : 0).padStart(11);
    const ratio = `${(wasm / js).toFixed(1)}x`;
    console.log(`${dtype.padEnd(9)} ${String(n).padStart(4)} ${f(js)} ${f(wasm).padStart(13)} ${ratio.padStart(10)}`);
  }
}
console.log(`WASM memory: ${MiB(kernel.memoryBytes)} (${MiB(kernel.placedBytes)} of weights)`);
