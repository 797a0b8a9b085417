// Small byte helpers shared by the worker's modules: bytes_core.ts's (no Node API), and the
// Node-only ones.

export * from "./bytes_core.js";

/** A Node Buffer over the same memory as `b` (no copy). */
export function asBuffer(b: Uint8Array): Buffer {
  return Buffer.from(b.buffer, b.byteOffset, b.byteLength);
}
