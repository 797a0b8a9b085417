// What an expert computes (PROTOCOL.md 11): one module, one function of a description of
// the expert function.
//
// For a row x routed to an expert with routing weight w, with G, U the gate and up
// projections ([I, H] each) and D the down projection ([H, I]):
//
//   g = G x (+ b_g),  u = U x (+ b_u)     the projections (returned for the row checks, 11.1)
//   h = gate(g, u)                        GLU: act(g) * u;  the clamped gates: below
//   y = D h (+ b_d)
//   out = y * w                           the routing weight last
//
// Precision (PROTOCOL.md 11, "Precision"): every step is rounded to the compute dtype (the
// model's); the matrix products accumulate here in float64 (at least float32, any order) and
// round once; the activation is computed in float32 one rounded operation after another, as
// torch does, then rounded to the compute dtype; the product with w is rounded to the wider
// of the compute dtype and the weights' dtype.

import { roundTo, rounder, wider, type FloatDType } from "./dtype.js";

/** How the gate and up projections combine into h. */
export type ExpertGate = "glu" | "clamped_swiglu" | "clamped_glu";

/** A description of the expert function. The default (`defaultFunction`) is a GLU with the
 * checkpoint's `hidden_act` over gate rows then up rows, stored [out, in], no biases. */
export interface ExpertFunction {
  gate: ExpertGate;
  /** The GLUs' activation by transformers' `hidden_act` name (silu, gelu, relu, ...). */
  activation: string;
  /** The clamped gates' parameters (gpt-oss: alpha 1.702, limit 7; the clamped GLU has no alpha). */
  alpha: number;
  limit: number;
  /** The stored [gate|up] outputs alternate: gate 0, up 0, gate 1, up 1, ... */
  interleaved: boolean;
  /** Stored [in, out]: gate_up [H, 2I], down [I, H]. */
  transposed: boolean;
  /** Biases: gate_up [2I] (laid out as the outputs are), down [H]. */
  bias: boolean;
}

export function defaultFunction(activation: string): ExpertFunction {
  return { gate: "glu", activation, alpha: 0, limit: 0, interleaved: false, transposed: false, bias: false };
}

/** One line naming `fn`, e.g. `GLU with silu` or `clamped SwiGLU (alpha 1.702, limit 7), interleaved`. */
export function describeFunction(fn: ExpertFunction): string {
  const head =
    fn.gate === "glu"
      ? `GLU with ${fn.activation}`
      : fn.gate === "clamped_glu"
        ? `clamped GLU with ${fn.activation} (limit ${fn.limit})`
        : `clamped SwiGLU (alpha ${fn.alpha}, limit ${fn.limit})`;
  const traits = [fn.interleaved && "interleaved", fn.transposed && "transposed", fn.bias && "biases"].filter(Boolean);
  return [head, ...traits].join(", ");
}

// -- activations, in float32, one rounded operation after another --------------------------

const fr = Math.fround;

/** erf in float64 (|error| far below float32's), by the series erf(x) = 2/sqrt(pi) e^{-x^2}
 * sum 2^n x^{2n+1} / (2n+1)!!, whose terms are all positive; |x| >= 6 gives +-1. */
export function erf(x: number): number {
  if (Number.isNaN(x)) return NaN;
  const a = Math.abs(x);
  if (a >= 6) return Math.sign(x);
  let term = a;
  let sum = a;
  for (let n = 1; n < 200; n++) {
    term *= (2 * a * a) / (2 * n + 1);
    sum += term;
    if (term < sum * 1e-17) break;
  }
  const r = (2 / Math.sqrt(Math.PI)) * Math.exp(-a * a) * sum;
  return x < 0 ? -r : r;
}

const SQRT1_2_F32 = fr(Math.SQRT1_2);
const GELU_TANH_BETA = fr(Math.SQRT2 * (2 / Math.sqrt(Math.PI)) * 0.5);
const GELU_TANH_KAPPA = fr(0.044715);
const GELU_NEW_SQRT = fr(Math.sqrt(2 / Math.PI));

/** The activations transformers registers under these `hidden_act` names, each in float32
 * operation by operation (torch's CPU kernels' formulas). */
const ACTIVATIONS: Record<string, (x: number) => number> = {
  silu: (x) => fr(x / fr(1 + fr(Math.exp(-x)))),
  swish: (x) => fr(x / fr(1 + fr(Math.exp(-x)))),
  relu: (x) => (x > 0 ? x : Number.isNaN(x) ? x : 0),
  // x * 0.5 * (1 + erf(x * sqrt(1/2)))
  gelu: (x) => fr(fr(x * 0.5) * fr(1 + fr(erf(fr(x * SQRT1_2_F32))))),
  // 0.5 * x * (1 + tanh(beta * (x + kappa * x^3)))
  gelu_pytorch_tanh: (x) => {
    const inner = fr(GELU_TANH_BETA * fr(x + fr(GELU_TANH_KAPPA * fr(fr(x * x) * x))));
    return fr(fr(0.5 * x) * fr(1 + fr(Math.tanh(inner))));
  },
  gelu_new: (x) => {
    const inner = fr(GELU_NEW_SQRT * fr(x + fr(GELU_TANH_KAPPA * fr(fr(x * x) * x))));
    return fr(fr(0.5 * x) * fr(1 + fr(Math.tanh(inner))));
  },
};

export const ACTIVATION_NAMES = Object.keys(ACTIVATIONS);

/** The activation named `name` (float32, op by op), or undefined when this worker does not implement it. */
export function activation(name: string): ((x: number) => number) | undefined {
  return ACTIVATIONS[name];
}

/** Check that this module computes `fn`; the reason it does not, else undefined. */
export function unsupported(fn: ExpertFunction): string | undefined {
  if (fn.gate === "glu" || fn.gate === "clamped_glu") {
    if (!ACTIVATIONS[fn.activation]) {
      return `hidden_act ${JSON.stringify(fn.activation)} is not implemented (known: ${ACTIVATION_NAMES.join(", ")})`;
    }
    return fn.gate === "glu" || (Number.isFinite(fn.limit) && fn.limit > 0) ? undefined : `a clamped GLU needs a positive limit (got ${fn.limit})`;
  }
  if (fn.gate === "clamped_swiglu") {
    return Number.isFinite(fn.alpha) && Number.isFinite(fn.limit) && fn.limit > 0
      ? undefined
      : `a clamped SwiGLU needs a finite alpha and a positive limit (got alpha ${fn.alpha}, limit ${fn.limit})`;
  }
  return `expert gate ${String(fn.gate)} is not implemented`;
}

// -- weights -------------------------------------------------------------------------------

/** One expert's weights in the kernel's layout: GU = [G; U] [2I, H] (gate rows, then up rows),
 * D [H, I], each row-major, values of the compute dtype; biases in the same order. */
export interface ExpertMatrices {
  H: number;
  I: number;
  GU: Float32Array;
  D: Float32Array;
  biasGU?: Float32Array; // [2I]: b_g then b_u
  biasD?: Float32Array; // [H]
}

/** The kernel's matrices from the weights as stored: gate_up ([2I, H], or [H, 2I] transposed;
 * its outputs gate then up, or alternating when interleaved) and down ([H, I], or [I, H]). */
export function matricesFromStored(
  fn: ExpertFunction,
  H: number,
  I: number,
  gateUp: Float32Array,
  down: Float32Array,
  biases?: { gateUp: Float32Array; down: Float32Array },
): ExpertMatrices {
  if (gateUp.length !== 2 * I * H || down.length !== H * I) {
    throw new Error(`expert weights of ${gateUp.length} and ${down.length} values, expected ${2 * I * H} and ${H * I}`);
  }
  // Output j of the stored [gate|up] is canonical row src(j).
  const src = (j: number): number => (!fn.interleaved ? j : j < I ? 2 * j : 2 * (j - I) + 1);
  let GU: Float32Array;
  if (!fn.transposed && !fn.interleaved) {
    GU = gateUp;
  } else {
    GU = new Float32Array(2 * I * H);
    for (let j = 0; j < 2 * I; j++) {
      const s = src(j);
      for (let k = 0; k < H; k++) GU[j * H + k] = fn.transposed ? gateUp[k * 2 * I + s]! : gateUp[s * H + k]!;
    }
  }
  let D = down;
  if (fn.transposed) {
    D = new Float32Array(H * I);
    for (let i = 0; i < H; i++) for (let j = 0; j < I; j++) D[i * I + j] = down[j * H + i]!;
  }
  const out: ExpertMatrices = { H, I, GU, D };
  if (fn.bias) {
    if (!biases || biases.gateUp.length !== 2 * I || biases.down.length !== H) {
      throw new Error(`the expert function has biases: gate_up [${2 * I}] and down [${H}] are needed`);
    }
    const bg = new Float32Array(2 * I);
    for (let j = 0; j < 2 * I; j++) bg[j] = biases.gateUp[src(j)]!;
    out.biasGU = bg;
    out.biasD = biases.down;
  }
  return out;
}

// -- the kernel ----------------------------------------------------------------------------

/** The result of one expert over n rows: `out` [n, H] (values of `outDType`, the wider of the
 * compute dtype and the weights' dtype) and the projections `proj` [n, 2I] ([g | u], values of
 * the compute dtype). */
export interface ExpertResult {
  out: Float64Array;
  outDType: FloatDType;
  proj: Float32Array;
}

/** A kernel computing experts: jsExpertForward below, the WASM-SIMD one (src/wasm/kernel.ts),
 * or the WebGPU one (src/webgpu/kernel.ts), whose results come back asynchronously. */
export type ExpertKernel = (
  fn: ExpertFunction,
  dtype: FloatDType,
  m: ExpertMatrices,
  rows: Float32Array,
  weights: ArrayLike<number>,
  weightsDType: FloatDType,
) => ExpertResult | Promise<ExpertResult>;

let kernel: ExpertKernel = jsExpertForward;

/** Make expertForward compute with `k` (the worker's `--kernel wasm`); none: this module's JS kernel. */
export function useExpertKernel(k?: ExpertKernel): void {
  kernel = k ?? jsExpertForward;
}

/** One expert over `n` rows, by the kernel in use (useExpertKernel; jsExpertForward unless set):
 * the result, or a promise of it from an asynchronous kernel (WebGPU's). */
export function expertForward(
  fn: ExpertFunction,
  dtype: FloatDType,
  m: ExpertMatrices,
  rows: Float32Array,
  weights: ArrayLike<number>,
  weightsDType: FloatDType,
): ExpertResult | Promise<ExpertResult> {
  return kernel(fn, dtype, m, rows, weights, weightsDType);
}

/**
 * The elementwise steps of one expert, around its two matrix products: what jsExpertForward
 * does with each sum, and what a kernel that computes only the sums (src/webgpu/kernel.ts) does
 * with its own, so the two differ only by the sums' summation order (PROTOCOL.md 11, "Precision").
 */
export interface ExpertSteps {
  /** The dtype of `out`: the wider of the compute dtype and the routing weights'. */
  readonly outDType: FloatDType;
  /** Projection j ([g | u], j < 2I) from its sum over H: rounded once to the compute dtype, then its bias added. */
  proj(s: number, j: number): number;
  /** h [I] of one row into `h` at `o`, from its projections `proj` [g | u] at `p`, each step rounded. */
  gate(proj: Float32Array, p: number, h: Float32Array, o: number): void;
  /** Output i (< H) from its sum over I and the row's routing weight `w`: rounded to the compute
   * dtype, its bias added, the product with `w` rounded to `outDType`. */
  out(s: number, i: number, w: number): number;
}

/** The elementwise steps of `fn` in `dtype` for `m` (throws what unsupported() says for a function it cannot compute). */
export function expertSteps(fn: ExpertFunction, dtype: FloatDType, m: ExpertMatrices, weightsDType: FloatDType): ExpertSteps {
  const I = m.I;
  const rc = rounder(dtype);
  const outDType = wider(dtype, weightsDType);
  const rw = rounder(outDType);
  const act = fn.gate === "clamped_swiglu" ? undefined : ACTIVATIONS[fn.activation];
  if (fn.gate !== "clamped_swiglu" && !act) throw new Error(unsupported(fn));
  // The clamped SwiGLU's scalars meet the tensor in float32 (torch's opmath for these dtypes).
  const alpha = fr(fn.alpha);
  const limit = fr(fn.limit);
  const biasGU = m.biasGU;
  const biasD = m.biasD;
  let gate: ExpertSteps["gate"];
  if (act && fn.gate === "glu") {
    gate = (proj, p, h, o) => {
      for (let j = 0; j < I; j++) h[o + j] = rc(rc(act(proj[p + j]!)) * proj[p + I + j]!);
    };
  } else if (act) {
    // the clamped GLU: h = act(min(g, limit)) * clamp(u, -limit, limit)
    gate = (proj, p, h, o) => {
      for (let j = 0; j < I; j++) {
        const g = proj[p + j]!;
        const u = proj[p + I + j]!;
        const gc = g > limit ? limit : g;
        const uc = u > limit ? limit : u < -limit ? -limit : u;
        h[o + j] = rc(rc(act(gc)) * uc);
      }
    };
  } else {
    // gpt-oss: g' = min(g, limit), u' = clamp(u, -limit, limit), h = (u' + 1) * (g' * sigmoid(g' * alpha))
    gate = (proj, p, h, o) => {
      for (let j = 0; j < I; j++) {
        const g = proj[p + j]!;
        const u = proj[p + I + j]!;
        const gc = g > limit ? limit : g;
        const uc = u > limit ? limit : u < -limit ? -limit : u;
        const t = rc(gc * alpha);
        const sig = rc(fr(1 / fr(1 + fr(Math.exp(-t)))));
        const glu = rc(gc * sig);
        h[o + j] = rc(rc(uc + 1) * glu);
      }
    };
  }
  return {
    outDType,
    proj: biasGU ? (s, j) => rc(rc(s) + biasGU[j]!) : (s) => rc(s),
    gate,
    out: biasD ? (s, i, w) => rw(rc(rc(s) + biasD[i]!) * w) : (s, _i, w) => rw(rc(s) * w),
  };
}

/**
 * One expert over `n` rows: `rows` [n, H] (values of the compute dtype, already widened from
 * a narrow wire), `weights` [n] (values of `weightsDType`).
 */
export function jsExpertForward(
  fn: ExpertFunction,
  dtype: FloatDType,
  m: ExpertMatrices,
  rows: Float32Array,
  weights: ArrayLike<number>,
  weightsDType: FloatDType,
): ExpertResult {
  const { H, I, GU, D } = m;
  const n = weights.length;
  if (rows.length !== n * H) throw new Error(`expertForward: ${rows.length} values for ${n} rows of ${H}`);
  const steps = expertSteps(fn, dtype, m, weightsDType);
  const proj = new Float32Array(n * 2 * I);
  const out = new Float64Array(n * H);
  // h's values are of the compute dtype (float32 at widest): a Float32Array holds them exactly.
  const h = new Float32Array(I);
  for (let r = 0; r < n; r++) {
    const x = r * H;
    const p = r * 2 * I;
    for (let j = 0; j < 2 * I; j++) {
      let s = 0;
      const row = j * H;
      for (let k = 0; k < H; k++) s += GU[row + k]! * rows[x + k]!;
      proj[p + j] = steps.proj(s, j);
    }
    steps.gate(proj, p, h, 0);
    const w = weights[r]!;
    const o = r * H;
    for (let i = 0; i < H; i++) {
      let s = 0;
      const row = i * I;
      for (let j = 0; j < I; j++) s += D[row + j]! * h[j]!;
      out[o + i] = steps.out(s, i, w);
    }
  }
  return { out, outDType: steps.outDType, proj };
}

/** `x` rounded to `dtype` (re-exported for callers that narrow the result to a wire dtype). */
export { roundTo };
