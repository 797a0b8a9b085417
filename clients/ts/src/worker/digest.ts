// The weights digest (PROTOCOL.md 12).

import { createHash } from "node:crypto";

import { ascii, u32le, u64le } from "./bytes.js";

export const WEIGHTS_DIGEST_DOMAIN = ascii("kvasir.v1.weights\0");

/** One tensor as the digest hashes it: torch's dtype name, its (2-D) shape, its raw bytes as stored. */
export interface DigestTensor {
  torchDType: string;
  shape: readonly number[];
  data: Uint8Array;
}

/** sha256 over (dtype name, NUL, u64le dims, bytes) of gate_up [2I, H], then of down [H, I]
 * (as stored: [H, 2I] and [I, H] when transposed), then, where the experts have biases, of
 * gate_up_bias [2I] and down_bias [H] (PROTOCOL.md 12). */
export function expertDigest(...tensors: DigestTensor[]): Uint8Array {
  const h = createHash("sha256");
  for (const t of tensors) {
    h.update(ascii(t.torchDType));
    h.update(new Uint8Array([0]));
    for (const d of t.shape) h.update(u64le(d));
    h.update(t.data);
  }
  return new Uint8Array(h.digest());
}

/** The digest a worker announces over `digests` (key: [layer, expert]), by ascending (layer, expert). */
export function slicesDigest(digests: Iterable<[[number, number], Uint8Array]>): Uint8Array {
  const sorted = [...digests].sort((a, b) => a[0][0] - b[0][0] || a[0][1] - b[0][1]);
  const h = createHash("sha256");
  h.update(WEIGHTS_DIGEST_DOMAIN);
  for (const [[layer, expert], d] of sorted) {
    h.update(u32le(layer));
    h.update(u32le(expert));
    h.update(d);
  }
  return new Uint8Array(h.digest());
}
