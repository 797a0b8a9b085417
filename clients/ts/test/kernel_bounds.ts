// How far another kernel's results may lie from the JS kernel's (src/worker/expert.ts) on the
// same inputs: the first-order bound the WASM kernel's tests apply (test/wasm.test.ts), for any
// float32 summation scheme, and PROTOCOL.md 11's audit bound. No Node API: the WebGPU kernel's
// tests run these in a web page (test/webgpu_page.ts).

import { create } from "@bufbuild/protobuf";

import { TensorSchema } from "../src/gen/kvasir/v1/tensor_pb.js";
import { fromHex } from "../src/worker/bytes_core.js";
import { decodeTensor, floatValues, unitRoundoff, wider, type FloatDType } from "../src/worker/dtype.js";
import { activation, type ExpertFunction, type ExpertMatrices, type ExpertResult } from "../src/worker/expert.js";

/** One expert's inputs. */
export interface ExpertInputs {
  m: ExpertMatrices;
  rows: Float32Array;
  weights: Float32Array;
}

/**
 * The most |kernel - JS| of each projection and each output element, from a first-order error
 * analysis of the two kernels on the same inputs (JS: float64 sums rounded once; the other:
 * float32 sums; every later step the same float32 operations, so the two differ only by what
 * the sums' difference carries through and by roundings it can tip the other way):
 *
 * - a float32 sum over K terms goes through at most `roundings(K)` float32 roundings per term
 *   (the WASM kernel: the product, the pair, K8/8 accumulations, two in the lanes' sum, so
 *   K8/8 + 5; one sequential sum: K + 1): |err| <= roundings(K) u_a S, S = sum |a_k x_k|,
 *   u_a = 2^-24 (float32 accumulation); the float64 sum's error is below u_a S / 2^29;
 * - each rounding to a dtype of unit roundoff u may land one unit either side on the two
 *   kernels: 2 u |v| (plus the dtype's smallest spacing near zero) for each rounded value v;
 * - the gate h = A(g) B(u) is 1.25-Lipschitz in g (silu, gelu and gpt-oss's g sigmoid(1.702 g)
 *   slope at most 1.1; relu 1) and 1-Lipschitz in u (clamps too), and each of its rounded
 *   operations adds its own 2 u |v|; the transcendental functions (exp, tanh, erf: V8's against
 *   AssemblyScript's, each within an ulp of float64) add 4 u_a (|A| + |g|);
 * - y = D h adds |D| (the h differences) to the sum's own error; out = y w multiplies by |w|.
 *
 * The bound is twice this (second-order terms), element by element.
 */
export function kernelTolerance(
  fn: ExpertFunction,
  dtype: FloatDType,
  weightsDType: FloatDType,
  e: ExpertInputs,
  js: ExpertResult,
  roundings: (K: number) => number,
): { proj: Float64Array; out: Float64Array } {
  const { H, I, GU, D } = e.m;
  const n = e.weights.length;
  const ua = 2 ** -24;
  const uc = unitRoundoff(dtype);
  const uo = unitRoundoff(wider(dtype, weightsDType));
  const tiny = dtype === "float16" ? 2 ** -24 : dtype === "bfloat16" ? 2 ** -133 : 2 ** -149;
  const flip = (v: number): number => 2 * uc * Math.abs(v) + tiny;
  const accH = roundings(H) * ua;
  const accI = roundings(I) * ua;
  const act = fn.gate === "clamped_swiglu" ? undefined : activation(fn.activation)!;
  const alpha = Math.fround(fn.alpha);
  const limit = Math.fround(fn.limit);
  const proj = new Float64Array(n * 2 * I);
  const out = new Float64Array(n * H);
  const dh = new Float64Array(I);
  const hAbs = new Float64Array(I);
  for (let r = 0; r < n; r++) {
    const x = e.rows.subarray(r * H, r * H + H);
    const p = js.proj.subarray(r * 2 * I, (r + 1) * 2 * I);
    for (let j = 0; j < 2 * I; j++) {
      let S = 0;
      for (let k = 0; k < H; k++) S += Math.abs(GU[j * H + k]! * x[k]!);
      const b = e.m.biasGU?.[j] ?? 0;
      proj[r * 2 * I + j] = accH * S + flip(Math.abs(p[j]!) + Math.abs(b)) + (e.m.biasGU ? flip(p[j]!) : 0);
    }
    for (let j = 0; j < I; j++) {
      const g = p[j]!;
      const u = p[I + j]!;
      const dg = proj[r * 2 * I + j]!;
      const du = proj[r * 2 * I + I + j]!;
      let A: number, B: number, dA: number;
      if (fn.gate === "clamped_swiglu") {
        const gc = Math.min(g, limit);
        const t = gc * alpha;
        const sig = 1 / (1 + Math.exp(-t));
        A = gc * sig;
        B = Math.max(-limit, Math.min(u, limit)) + 1;
        // t, sigmoid (its slope relative to t: t (1 - sig)) and g' sig each rounded
        dA = 1.25 * dg + Math.abs(gc) * (flip(sig) + sig * (1 - sig) * flip(t)) + flip(A);
        dA += 4 * ua * (Math.abs(A) + Math.abs(gc));
      } else {
        const gc = fn.gate === "clamped_glu" ? Math.min(g, limit) : g;
        A = act!(gc);
        B = fn.gate === "clamped_glu" ? Math.max(-limit, Math.min(u, limit)) : u;
        dA = 1.25 * dg + flip(A) + 4 * ua * (Math.abs(A) + Math.abs(gc));
      }
      const dB = du + (fn.gate === "clamped_swiglu" ? flip(B) : 0);
      hAbs[j] = Math.abs(A * B);
      dh[j] = Math.abs(B) * dA + Math.abs(A) * dB + flip(A * B);
    }
    const w = Math.abs(e.weights[r]!);
    for (let i = 0; i < H; i++) {
      let S = 0;
      let carried = 0;
      for (let j = 0; j < I; j++) {
        S += Math.abs(D[i * I + j]!) * hAbs[j]!;
        carried += Math.abs(D[i * I + j]!) * dh[j]!;
      }
      const y = w > 0 ? Math.abs(js.out[r * H + i]!) / w : 0;
      const b = e.m.biasD?.[i] ?? 0;
      const dy = carried + accI * S + flip(y + Math.abs(b)) + (e.m.biasD ? flip(y) : 0);
      out[r * H + i] = w * dy + 2 * uo * Math.abs(js.out[r * H + i]!) + tiny;
    }
  }
  for (let i = 0; i < proj.length; i++) proj[i]! *= 2;
  for (let i = 0; i < out.length; i++) out[i]! *= 2;
  return { proj, out };
}

/** The factors A(g), B(u) of h = A B (kvasir_rpc's ExpertFunction.factors), in float64. */
function factors(fn: ExpertFunction): (g: number, u: number) => [number, number] {
  const limit = fn.limit;
  if (fn.gate === "clamped_swiglu") {
    return (g, u) => {
      const gc = Math.min(g, limit);
      return [gc / (1 + Math.exp(-gc * fn.alpha)), Math.max(-limit, Math.min(u, limit)) + 1];
    };
  }
  const act = activation(fn.activation)!;
  if (fn.gate === "clamped_glu") return (g, u) => [act(Math.min(g, limit)), Math.max(-limit, Math.min(u, limit))];
  return (g, u) => [act(g), u];
}

/**
 * PROTOCOL.md 11's audit bound on each output element against the reference `ref` (here the JS
 * kernel's output, in the compute dtype): 8 u_c E + 8 u_c |ref|, with E the expert's error scale
 * (kvasir_rpc/_tolerance.py's error_scale, in float64 from the rows and weights given).
 */
export function auditBound(fn: ExpertFunction, dtype: FloatDType, e: ExpertInputs, ref: ArrayLike<number>): Float64Array {
  const { H, I, GU, D } = e.m;
  const n = e.weights.length;
  const uc = unitRoundoff(dtype);
  const ab = factors(fn);
  const roundings = fn.gate === "clamped_swiglu" ? 5 : 2;
  const bound = new Float64Array(n * H);
  const h = new Float64Array(I);
  const eh = new Float64Array(I);
  for (let r = 0; r < n; r++) {
    const x = e.rows.subarray(r * H, r * H + H);
    for (let j = 0; j < I; j++) {
      let g = 0;
      let u = 0;
      let g2 = 0;
      let u2 = 0;
      for (let k = 0; k < H; k++) {
        const wg = GU[j * H + k]!;
        const wu = GU[(I + j) * H + k]!;
        g += wg * x[k]!;
        u += wu * x[k]!;
        g2 += wg * wg * x[k]! * x[k]!;
        u2 += wu * wu * x[k]! * x[k]!;
      }
      let eg = Math.sqrt(H) * Math.sqrt(g2);
      let eu = Math.sqrt(H) * Math.sqrt(u2);
      if (e.m.biasGU) {
        const bg = e.m.biasGU[j]!;
        const bu = e.m.biasGU[I + j]!;
        eg += Math.abs(g + bg) + Math.abs(bg);
        eu += Math.abs(u + bu) + Math.abs(bu);
        g += bg;
        u += bu;
      }
      const [a, b] = ab(g, u);
      const step = 1e-3 * (1 + Math.abs(g));
      const slope = Math.abs(ab(g + step, u)[0] - ab(g - step, u)[0]) / (2 * step);
      h[j] = a * b;
      eh[j] = slope * Math.abs(b) * eg + Math.abs(a) * eu + (roundings / 2) * Math.abs(a * b);
    }
    const w = Math.abs(e.weights[r]!);
    for (let i = 0; i < H; i++) {
      let y = 0;
      let hd2 = 0;
      let ed2 = 0;
      for (let j = 0; j < I; j++) {
        const d = D[i * I + j]!;
        y += d * h[j]!;
        hd2 += h[j]! * h[j]! * d * d;
        ed2 += eh[j]! * eh[j]! * d * d;
      }
      if (e.m.biasD) y += e.m.biasD[i]!;
      let E = w * (Math.sqrt(I) * Math.sqrt(hd2) + Math.sqrt(ed2)) + Math.abs(y * w);
      if (e.m.biasD) E += w * Math.abs(e.m.biasD[i]!);
      bound[r * H + i] = 8 * uc * E + 8 * uc * Math.abs(ref[r * H + i]!);
    }
  }
  return bound;
}

/** The largest |got - want| / bound (<= 1 passes), and where. */
export function worst(
  got: ArrayLike<number>,
  want: ArrayLike<number>,
  bound: ArrayLike<number>,
): { ratio: number; at: number } {
  let ratio = 0;
  let at = -1;
  for (let i = 0; i < want.length; i++) {
    const d = Math.abs(got[i]! - want[i]!);
    const q = d === 0 ? 0 : d / bound[i]!;
    if (!(q <= ratio)) {
      ratio = q;
      at = i;
    }
  }
  return { ratio, at };
}

/** A JSON tensor of tests/vectors ({dtype, shape, data_hex}) as float32 values. */
export function vectorValues(t: { dtype: string; shape: number[]; data_hex: string }): Float32Array {
  const dtype = { float32: 1, float16: 2, bfloat16: 3 }[t.dtype]!;
  return floatValues(decodeTensor(create(TensorSchema, { dtype, shape: t.shape.map(BigInt), data: fromHex(t.data_hex) })));
}

/** Within `ulps` units in the last place of `want` (of `dtype`; values near zero: of 2^-10), as the
 * kernels' tests check the Python worker's vectors. */
export function closeUlps(got: number, want: number, ulps: number, dtype: FloatDType): boolean {
  const u = dtype === "float32" ? 2 ** -23 : dtype === "bfloat16" ? 2 ** -7 : 2 ** -10;
  return Math.abs(got - want) <= ulps * u * Math.max(Math.abs(want), 2 ** -10);
}
