// Floating-point formats (float32, bfloat16, float16) and kvasir.v1.Tensor (PROTOCOL.md 10).
//
// JavaScript computes in float64; a value "rounded to dtype D" here is a JS number holding
// exactly a value of D (round to nearest, ties to even), so later arithmetic on it is exact
// input for the next rounding.

import { create } from "@bufbuild/protobuf";

import { DType, TensorSchema, type Tensor } from "../gen/kvasir/v1/tensor_pb.js";

/** The floating-point dtypes a model computes in. */
export type FloatDType = "float32" | "bfloat16" | "float16";

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** float32 bits of the float32 value nearest `x`. */
function f32Bits(x: number): number {
  f32[0] = x;
  return u32[0]!;
}

function fromF32Bits(bits: number): number {
  u32[0] = bits >>> 0;
  return f32[0]!;
}

/** bfloat16 bits of `x` (first rounded to float32, as torch's float32 result would be), ties to even. */
export function toBf16Bits(x: number): number {
  const bits = f32Bits(x);
  if ((bits & 0x7f800000) === 0x7f800000 && (bits & 0x007fffff) !== 0) return ((bits >>> 16) & 0x8000) | 0x7fc0; // NaN
  const lsb = (bits >>> 16) & 1;
  return ((bits + 0x7fff + lsb) >>> 16) & 0xffff;
}

export function fromBf16Bits(b: number): number {
  return fromF32Bits((b & 0xffff) << 16);
}

/** Round half to even of a non-negative float64 `v` to an integer. */
function rintEven(v: number): number {
  const fl = Math.floor(v);
  const frac = v - fl;
  if (frac > 0.5) return fl + 1;
  if (frac < 0.5) return fl;
  return fl % 2 === 0 ? fl : fl + 1;
}

/** float16 bits of `x` (first rounded to float32), ties to even; overflow gives infinity. */
export function toF16Bits(x: number): number {
  const v = Math.fround(x);
  if (Number.isNaN(v)) return 0x7e00;
  const sign = v < 0 || Object.is(v, -0) ? 0x8000 : 0;
  const a = Math.abs(v);
  if (a === Infinity) return sign | 0x7c00;
  if (a < 2 ** -14) {
    // subnormal (or zero): units of 2^-24
    const q = rintEven(a * 2 ** 24);
    return sign | q; // q == 1024 rolls into the smallest normal, whose bits are exactly 0x0400
  }
  let e = Math.floor(Math.log2(a));
  if (2 ** e > a) e -= 1;
  if (2 ** (e + 1) <= a) e += 1;
  let m = rintEven((a / 2 ** e - 1) * 1024);
  if (m === 1024) {
    m = 0;
    e += 1;
  }
  if (e > 15) return sign | 0x7c00;
  return sign | ((e + 15) << 10) | m;
}

export function fromF16Bits(b: number): number {
  const sign = b & 0x8000 ? -1 : 1;
  const e = (b >>> 10) & 0x1f;
  const m = b & 0x3ff;
  if (e === 0) return sign * m * 2 ** -24;
  if (e === 31) return m ? NaN : sign * Infinity;
  return sign * (1 + m / 1024) * 2 ** (e - 15);
}

/** `x` rounded to `dtype` (through float32, as torch rounds a float32 result), as a number. */
export function roundTo(dtype: FloatDType, x: number): number {
  switch (dtype) {
    case "float32":
      return Math.fround(x);
    case "bfloat16":
      return fromBf16Bits(toBf16Bits(x));
    case "float16":
      return fromF16Bits(toF16Bits(x));
  }
}

/** A rounding function for `dtype`. */
export function rounder(dtype: FloatDType): (x: number) => number {
  switch (dtype) {
    case "float32":
      return Math.fround;
    case "bfloat16":
      return (x) => fromBf16Bits(toBf16Bits(x));
    case "float16":
      return (x) => fromF16Bits(toF16Bits(x));
  }
}

/** The unit roundoff of `dtype`. */
export function unitRoundoff(dtype: FloatDType): number {
  return dtype === "float32" ? 2 ** -24 : dtype === "bfloat16" ? 2 ** -8 : 2 ** -11;
}

/** The wider of two float dtypes, as torch promotes them (bfloat16 with float16 is float32). */
export function wider(a: FloatDType, b: FloatDType): FloatDType {
  if (a === b) return a;
  return "float32";
}

export const ITEM_SIZE: Record<FloatDType, number> = { float32: 4, bfloat16: 2, float16: 2 };

export function wireDType(d: FloatDType): DType {
  return d === "float32" ? DType.FLOAT32 : d === "bfloat16" ? DType.BFLOAT16 : DType.FLOAT16;
}

export function floatDTypeOf(d: DType): FloatDType | undefined {
  return d === DType.FLOAT32 ? "float32" : d === DType.BFLOAT16 ? "bfloat16" : d === DType.FLOAT16 ? "float16" : undefined;
}

const WIRE_ITEM_SIZE: Partial<Record<number, number>> = {
  [DType.FLOAT32]: 4,
  [DType.FLOAT16]: 2,
  [DType.BFLOAT16]: 2,
  [DType.INT32]: 4,
  [DType.INT64]: 8,
};

const DTYPE_NAME: Partial<Record<number, string>> = {
  [DType.FLOAT32]: "float32",
  [DType.FLOAT16]: "float16",
  [DType.BFLOAT16]: "bfloat16",
  [DType.INT32]: "int32",
  [DType.INT64]: "int64",
};

export function dtypeName(d: DType): string {
  return DTYPE_NAME[d] ?? `dtype ${d}`;
}

/** A Tensor refused by the decoder (INVALID_ARGUMENT). */
export class TensorCodecError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "TensorCodecError";
  }
}

/** A decoded tensor: its dtype, shape and raw little-endian bytes (a fresh, aligned copy). */
export interface RawTensor {
  dtype: DType;
  shape: number[];
  data: Uint8Array;
}

const MAX_EXTENT = 2 ** 31;

/** Check and decode a Tensor message (PROTOCOL.md 10). Throws TensorCodecError. */
export function decodeTensor(t: Tensor | undefined, what = "tensor"): RawTensor {
  if (t === undefined) throw new TensorCodecError(`${what}: missing`);
  const itemSize = WIRE_ITEM_SIZE[t.dtype];
  if (itemSize === undefined) {
    throw new TensorCodecError(`${what}: dtype ${t.dtype} is ${t.dtype === DType.UNSPECIFIED ? "unspecified" : "unknown"}`);
  }
  let count = 1n;
  let extent = 1n;
  for (const d of t.shape) {
    count *= d;
    extent *= d > 1n ? d : 1n;
    if (extent > BigInt(MAX_EXTENT)) {
      throw new TensorCodecError(`${what}: shape [${t.shape.join(", ")}] exceeds 2^31 elements`);
    }
  }
  const want = count * BigInt(itemSize);
  if (BigInt(t.data.byteLength) !== want) {
    throw new TensorCodecError(
      `${what}: ${t.data.byteLength} bytes of data for ${dtypeName(t.dtype)} [${t.shape.join(", ")}], expected ${want}`,
    );
  }
  return { dtype: t.dtype, shape: t.shape.map(Number), data: t.data.slice() };
}

/** The values of a floating-point tensor, as a Float32Array (every value of the three formats is a float32). */
export function floatValues(t: RawTensor): Float32Array {
  const n = t.shape.reduce((a, b) => a * b, 1);
  switch (t.dtype) {
    case DType.FLOAT32:
      return new Float32Array(t.data.buffer, t.data.byteOffset, n);
    case DType.BFLOAT16: {
      const src = new Uint16Array(t.data.buffer, t.data.byteOffset, n);
      const out = new Float32Array(n);
      const bits = new Uint32Array(out.buffer);
      for (let i = 0; i < n; i++) bits[i] = src[i]! << 16;
      return out;
    }
    case DType.FLOAT16: {
      const src = new Uint16Array(t.data.buffer, t.data.byteOffset, n);
      const out = new Float32Array(n);
      for (let i = 0; i < n; i++) out[i] = fromF16Bits(src[i]!);
      return out;
    }
    default:
      throw new TensorCodecError(`${dtypeName(t.dtype)} is not floating point`);
  }
}

/** The raw bytes of `values` in `dtype` (each value rounded to nearest even when narrowed). */
export function encodeValues(dtype: FloatDType, values: ArrayLike<number>): Uint8Array {
  const n = values.length;
  if (dtype === "float32") {
    const out = Float32Array.from(values as ArrayLike<number>);
    return new Uint8Array(out.buffer);
  }
  const out = new Uint16Array(n);
  const conv = dtype === "bfloat16" ? toBf16Bits : toF16Bits;
  for (let i = 0; i < n; i++) out[i] = conv(values[i]!);
  return new Uint8Array(out.buffer);
}

/** A Tensor message of `dtype` and `shape` holding `values`. */
export function encodeTensor(dtype: FloatDType, shape: number[], values: ArrayLike<number>): Tensor {
  return create(TensorSchema, { dtype: wireDType(dtype), shape: shape.map(BigInt), data: encodeValues(dtype, values) });
}

/** Whether this machine stores numbers little-endian (typed arrays over wire bytes need it). */
export function isLittleEndian(): boolean {
  return new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
}
