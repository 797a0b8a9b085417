// The weights digest (PROTOCOL.md 12) without its hash: the bytes SHA-256 runs over, in order.
// No Node API: digest.ts hashes them with node:crypto, the browser worker with WebCrypto.

import { ascii, u32le, u64le } from "./bytes_core.js";

export const WEIGHTS_DIGEST_DOMAIN = ascii("kvasir.v1.weights\0");

/** One tensor as the digest hashes it: torch's dtype name, its (2-D) shape, its raw bytes as stored. */
export interface DigestTensor {
  torchDType: string;
  shape: readonly number[];
  data: Uint8Array;
}

/** What one expert's digest hashes: (dtype name, NUL, u64le dims, bytes) of each tensor. */
export function expertDigestChunks(...tensors: DigestTensor[]): Uint8Array[] {
  const out: Uint8Array[] = [];
  for (const t of tensors) {
    out.push(ascii(t.torchDType), new Uint8Array([0]));
    for (const d of t.shape) out.push(u64le(d));
    out.push(t.data);
  }
  return out;
}

/** What the digest over `digests` (key: [layer, expert]) hashes, by ascending (layer, expert). */
export function slicesDigestChunks(digests: Iterable<[[number, number], Uint8Array]>): Uint8Array[] {
  const sorted = [...digests].sort((a, b) => a[0][0] - b[0][0] || a[0][1] - b[0][1]);
  const out: Uint8Array[] = [WEIGHTS_DIGEST_DOMAIN];
  for (const [[layer, expert], d] of sorted) out.push(u32le(layer), u32le(expert), d);
  return out;
}
