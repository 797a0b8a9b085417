// Seeded random values for the kernels' tests and measurements (no Node API: a page imports it
// too): the same experts on every run and in every runtime.

import { rounder, type FloatDType } from "./dtype.js";

/** A seeded generator of uniform [0, 1) (mulberry32). */
export function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** `len` values uniform in [-scale, scale), rounded to `dtype`. */
export function randomValues(rand: () => number, len: number, scale: number, dtype: FloatDType): Float32Array {
  const r = rounder(dtype);
  return Float32Array.from({ length: len }, () => r((2 * rand() - 1) * scale));
}
