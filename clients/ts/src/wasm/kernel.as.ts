// @ts-nocheck -- AssemblyScript (compiled by `npm run build:wasm` into kernel.wasm), not TypeScript.
//
// One expert over a block of rows, as src/worker/expert.ts's expertForward computes it, with
// 128-bit SIMD (f32x4) for the three matrix products:
//
//   p = GU x (+ b_gu)   [2I]  rounded to the compute dtype      (the projections [g | u])
//   h = gate(g, u)      [I]   float32 one rounded operation after another, each rounded to the dtype
//   y = D h (+ b_d)     [H]   rounded to the compute dtype
//   out = y * w               rounded to the wider of the compute and routing-weight dtypes
//
// The products accumulate in float32 (PROTOCOL.md 11, "Precision": at least float32, any
// order): per dot product, four lanes each summing (a x)[k] + (a x)[k + 4] over the blocks of 8
// values, the lanes added pairwise at the end.
//
// Memory is the caller's (src/wasm/kernel.ts): every pointer is a byte offset, 16-byte aligned;
// a matrix [M, K] is stored row-major with its rows padded with zeros to a multiple of 8 values
// (K8), as float32 or, for bfloat16 weights, as the upper halves of their float32 bits (u16);
// the rows x [n, H8] and h [n, I8] are float32, padded with zeros likewise.

// -- dtypes (codes shared with kernel.ts) -----------------------------------------------------

const DT_F32: i32 = 0;
const DT_BF16: i32 = 1;
const DT_F16: i32 = 2;

/** float32 `x` rounded to bfloat16 (nearest, ties to even; NaN stays NaN), as float32. */
function roundBf16(x: f32): f32 {
  const b = reinterpret<u32>(x);
  if ((b & 0x7f800000) == 0x7f800000 && (b & 0x007fffff) != 0) {
    return reinterpret<f32>((((b >>> 16) & 0x8000) | 0x7fc0) << 16); // NaN: a quiet one
  }
  const lsb = (b >>> 16) & 1;
  return reinterpret<f32>(((b + 0x7fff + lsb) >>> 16) << 16);
}

/** float32 `x` rounded to float16 (nearest, ties to even, overflow to infinity), as float32. */
function roundF16(x: f32): f32 {
  const b = reinterpret<u32>(x);
  const sign = b & 0x80000000;
  const a = b & 0x7fffffff;
  if (a >= 0x7f800000) return x; // infinity, NaN
  // >= 65520: past the largest finite, 65504 (a tie goes to even: up, to infinity)
  if (a >= 0x477ff000) return reinterpret<f32>(sign | 0x7f800000);
  if (a < 0x38800000) {
    // below 2^-14: float16's subnormals, multiples of 2^-24 (the scalings are exact)
    const q = nearest<f32>(reinterpret<f32>(a) * <f32>16777216.0) * <f32>5.9604644775390625e-8;
    return reinterpret<f32>(sign | reinterpret<u32>(q));
  }
  const lsb = (a >>> 13) & 1;
  return reinterpret<f32>(sign | ((a + 0xfff + lsb) & 0xffffe000));
}

function roundTo(dt: i32, x: f32): f32 {
  if (dt == DT_BF16) return roundBf16(x);
  if (dt == DT_F16) return roundF16(x);
  return x;
}

// -- activations, in float32, one rounded operation after another (as expert.ts) --------------

const ACT_SILU: i32 = 0;
const ACT_RELU: i32 = 1;
const ACT_GELU: i32 = 2;
const ACT_GELU_TANH: i32 = 3; // gelu_pytorch_tanh
const ACT_GELU_NEW: i32 = 4;

const SQRT1_2_F32: f32 = <f32>0.7071067811865476;
const GELU_TANH_BETA: f32 = <f32>(1.4142135623730951 * (2.0 / 1.7724538509055159) * 0.5);
const GELU_TANH_KAPPA: f32 = <f32>0.044715;
const GELU_NEW_SQRT: f32 = <f32>0.7978845608028654; // sqrt(2 / pi)

/** erf in float64, by the series of expert.ts (terms all positive; |x| >= 6 gives +-1). */
function erf64(x: f64): f64 {
  if (isNaN<f64>(x)) return x;
  const a = Math.abs(x);
  if (a >= 6.0) return x < 0 ? -1.0 : 1.0;
  let term = a;
  let sum = a;
  for (let n = 1; n < 200; n++) {
    term *= (2.0 * a * a) / <f64>(2 * n + 1);
    sum += term;
    if (term < sum * 1e-17) break;
  }
  const r = (2.0 / Math.sqrt(Math.PI)) * Math.exp(-a * a) * sum;
  return x < 0 ? -r : r;
}

function activate(act: i32, x: f32): f32 {
  if (act == ACT_SILU) {
    const e = <f32>Math.exp(-<f64>x);
    return x / (<f32>1.0 + e);
  }
  if (act == ACT_RELU) return x > 0 ? x : isNaN<f32>(x) ? x : <f32>0.0;
  if (act == ACT_GELU) {
    const e = <f32>erf64(<f64>(x * SQRT1_2_F32));
    return (x * <f32>0.5) * (<f32>1.0 + e);
  }
  const c = act == ACT_GELU_TANH ? GELU_TANH_BETA : GELU_NEW_SQRT;
  const inner = c * (x + GELU_TANH_KAPPA * ((x * x) * x));
  return (<f32>0.5 * x) * (<f32>1.0 + <f32>Math.tanh(<f64>inner));
}

// -- the matrix products ----------------------------------------------------------------------

/** The weights at `p`, 8 values: float32 (W = f32) or bfloat16 bits (W = u16), as two f32x4. */
// @ts-ignore: decorator
@inline
function wlo<W>(p: usize): v128 {
  if (sizeof<W>() == 2) return i32x4.shl(i32x4.extend_low_i16x8_u(v128.load(p)), 16);
  return v128.load(p);
}

// @ts-ignore: decorator
@inline
function whi<W>(p: usize): v128 {
  if (sizeof<W>() == 2) return i32x4.shl(i32x4.extend_high_i16x8_u(v128.load(p)), 16);
  return v128.load(p, 16);
}

// @ts-ignore: decorator
@inline
function hsum(v: v128): f32 {
  return (f32x4.extract_lane(v, 0) + f32x4.extract_lane(v, 1)) + (f32x4.extract_lane(v, 2) + f32x4.extract_lane(v, 3));
}

// @ts-ignore: decorator
@inline
function madd<W>(s: v128, a: usize, pw: usize, vl: v128, vh: v128): v128 {
  return f32x4.add(s, f32x4.add(f32x4.mul(wlo<W>(a + pw), vl), f32x4.mul(whi<W>(a + pw), vh)));
}

/** Rows j and j + 1 (`two`: else j alone) of A at a0, a1 against rows r..r+3 of x at x0 (4 rows of xrow bytes). */
// @ts-ignore: decorator
@inline
function block2x4<W>(a0: usize, a1: usize, x0: usize, xrow: usize, K8: i32, y0: usize, yr: usize, two: bool): void {
  const x1 = x0 + xrow;
  const x2 = x1 + xrow;
  const x3 = x2 + xrow;
  let s00 = f32x4.splat(0), s01 = f32x4.splat(0), s02 = f32x4.splat(0), s03 = f32x4.splat(0);
  let s10 = f32x4.splat(0), s11 = f32x4.splat(0), s12 = f32x4.splat(0), s13 = f32x4.splat(0);
  for (let k = 0; k < K8; k += 8) {
    const pw = <usize>k * sizeof<W>();
    const px = <usize>k << 2;
    const w0l = wlo<W>(a0 + pw);
    const w0h = whi<W>(a0 + pw);
    const w1l = wlo<W>(a1 + pw);
    const w1h = whi<W>(a1 + pw);
    let vl = v128.load(x0 + px);
    let vh = v128.load(x0 + px, 16);
    s00 = f32x4.add(s00, f32x4.add(f32x4.mul(w0l, vl), f32x4.mul(w0h, vh)));
    s10 = f32x4.add(s10, f32x4.add(f32x4.mul(w1l, vl), f32x4.mul(w1h, vh)));
    vl = v128.load(x1 + px);
    vh = v128.load(x1 + px, 16);
    s01 = f32x4.add(s01, f32x4.add(f32x4.mul(w0l, vl), f32x4.mul(w0h, vh)));
    s11 = f32x4.add(s11, f32x4.add(f32x4.mul(w1l, vl), f32x4.mul(w1h, vh)));
    vl = v128.load(x2 + px);
    vh = v128.load(x2 + px, 16);
    s02 = f32x4.add(s02, f32x4.add(f32x4.mul(w0l, vl), f32x4.mul(w0h, vh)));
    s12 = f32x4.add(s12, f32x4.add(f32x4.mul(w1l, vl), f32x4.mul(w1h, vh)));
    vl = v128.load(x3 + px);
    vh = v128.load(x3 + px, 16);
    s03 = f32x4.add(s03, f32x4.add(f32x4.mul(w0l, vl), f32x4.mul(w0h, vh)));
    s13 = f32x4.add(s13, f32x4.add(f32x4.mul(w1l, vl), f32x4.mul(w1h, vh)));
  }
  store<f32>(y0, hsum(s00));
  store<f32>(y0 + yr, hsum(s01));
  store<f32>(y0 + 2 * yr, hsum(s02));
  store<f32>(y0 + 3 * yr, hsum(s03));
  if (two) {
    store<f32>(y0, hsum(s10), 4);
    store<f32>(y0 + yr, hsum(s11), 4);
    store<f32>(y0 + 2 * yr, hsum(s12), 4);
    store<f32>(y0 + 3 * yr, hsum(s13), 4);
  }
}

/**
 * y[r * ldy + j] = sum_k A[j, k] x[r, k] for j < M, r < n: A [M, K8] of W at `a`, x [n, K8]
 * float32 at `x`, y float32 at `y`. Four rows of A at a time: against four rows of x at a time,
 * two by two (eight accumulators: A's rows are read once per four rows of x), then the rows of
 * x left over one by one against all four. Every dot product is summed the same way, s += (A
 * x)[k..k+3] + (A x)[k+4..k+7] lane by lane, then the lanes pairwise, so a row's result does not
 * depend on the other rows of the call.
 */
function matmul<W>(a: usize, M: i32, K8: i32, x: usize, n: i32, y: usize, ldy: i32): void {
  const wrow = <usize>K8 * sizeof<W>(); // bytes of a row of A
  const xrow = <usize>K8 << 2; // bytes of a row of x
  const yr = <usize>ldy << 2;
  for (let j = 0; j < M; j += 4) {
    const m = min(4, M - j); // rows of A in this group; the missing ones repeat row j, their results dropped
    const a0 = a + <usize>j * wrow;
    const a1 = m > 1 ? a0 + wrow : a0;
    const a2 = m > 2 ? a0 + 2 * wrow : a0;
    const a3 = m > 3 ? a0 + 3 * wrow : a0;
    let r = 0;
    for (; r + 4 <= n; r += 4) {
      const x0 = x + <usize>r * xrow;
      const y0 = y + ((<usize>r * <usize>ldy + <usize>j) << 2);
      block2x4<W>(a0, a1, x0, xrow, K8, y0, yr, m > 1);
      if (m > 2) block2x4<W>(a2, a3, x0, xrow, K8, y0 + 8, yr, m > 3);
    }
    for (; r < n; r++) {
      const x0 = x + <usize>r * xrow;
      let s0 = f32x4.splat(0), s1 = f32x4.splat(0), s2 = f32x4.splat(0), s3 = f32x4.splat(0);
      for (let k = 0; k < K8; k += 8) {
        const pw = <usize>k * sizeof<W>();
        const px = <usize>k << 2;
        const vl = v128.load(x0 + px);
        const vh = v128.load(x0 + px, 16);
        s0 = madd<W>(s0, a0, pw, vl, vh);
        s1 = madd<W>(s1, a1, pw, vl, vh);
        s2 = madd<W>(s2, a2, pw, vl, vh);
        s3 = madd<W>(s3, a3, pw, vl, vh);
      }
      const y0 = y + ((<usize>r * <usize>ldy + <usize>j) << 2);
      store<f32>(y0, hsum(s0));
      if (m > 1) store<f32>(y0, hsum(s1), 4);
      if (m > 2) store<f32>(y0, hsum(s2), 8);
      if (m > 3) store<f32>(y0, hsum(s3), 12);
    }
  }
}

// -- the expert ---------------------------------------------------------------------------------

const GATE_GLU: i32 = 0;
const GATE_CLAMPED_GLU: i32 = 1;
const GATE_CLAMPED_SWIGLU: i32 = 2;

/** Where the caller may place its data: the first free byte after this module's own. */
export function heapBase(): usize {
  return __heap_base;
}

/**
 * One expert over `n` rows. Weights: gu [2I, H8] and d [H, I8] (wbf16: bfloat16 bits, else
 * float32), biases bgu [2I] and bd [H] (float32; 0: none). Rows x [n, H8] (padding zero),
 * routing weights w [n]. Out: proj [n, 2I] (rounded to `cdt`), out [n, H] (rounded to `odt`);
 * h [n, I8] is scratch (its padding is written zero here).
 */
export function forward(
  H: i32, I: i32, H8: i32, I8: i32, gu: usize, d: usize, bgu: usize, bd: usize, wbf16: bool,
  n: i32, x: usize, w: usize, proj: usize, h: usize, out: usize,
  gate: i32, act: i32, alpha: f32, limit: f32, cdt: i32, odt: i32,
): void {
  const I2 = 2 * I;
  if (wbf16) matmul<u16>(gu, I2, H8, x, n, proj, I2);
  else matmul<f32>(gu, I2, H8, x, n, proj, I2);
  for (let r = 0; r < n; r++) {
    const p = proj + ((<usize>r * <usize>I2) << 2);
    for (let j = 0; j < I2; j++) {
      const at = p + (<usize>j << 2);
      let v = roundTo(cdt, load<f32>(at));
      if (bgu) v = roundTo(cdt, v + load<f32>(bgu + (<usize>j << 2)));
      store<f32>(at, v);
    }
    const hr = h + ((<usize>r * <usize>I8) << 2);
    for (let j = 0; j < I; j++) {
      const g = load<f32>(p + (<usize>j << 2));
      const u = load<f32>(p + (<usize>(I + j) << 2));
      let v: f32;
      if (gate == GATE_GLU) {
        v = roundTo(cdt, roundTo(cdt, activate(act, g)) * u);
      } else {
        const gc = g > limit ? limit : g;
        const uc = u > limit ? limit : u < -limit ? -limit : u;
        if (gate == GATE_CLAMPED_GLU) {
          v = roundTo(cdt, roundTo(cdt, activate(act, gc)) * uc);
        } else {
          // gpt-oss: (u' + 1) * (g' * sigmoid(g' * alpha))
          const t = roundTo(cdt, gc * alpha);
          const e = <f32>Math.exp(-<f64>t);
          const sig = roundTo(cdt, <f32>1.0 / (<f32>1.0 + e));
          const glu = roundTo(cdt, gc * sig);
          v = roundTo(cdt, roundTo(cdt, uc + <f32>1.0) * glu);
        }
      }
      store<f32>(hr + (<usize>j << 2), v);
    }
    for (let j = I; j < I8; j++) store<f32>(hr + (<usize>j << 2), 0);
  }
  if (wbf16) matmul<u16>(d, H, I8, h, n, out, H);
  else matmul<f32>(d, H, I8, h, n, out, H);
  for (let r = 0; r < n; r++) {
    const o = out + ((<usize>r * <usize>H) << 2);
    const wr = load<f32>(w + (<usize>r << 2));
    for (let i = 0; i < H; i++) {
      const at = o + (<usize>i << 2);
      let v = roundTo(cdt, load<f32>(at));
      if (bd) v = roundTo(cdt, v + load<f32>(bd + (<usize>i << 2)));
      store<f32>(at, roundTo(odt, v * wr));
    }
  }
}
