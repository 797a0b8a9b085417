// The weights digest (PROTOCOL.md 12), hashed with node:crypto; what is hashed is digest_core.ts's.

import { createHash } from "node:crypto";

import { expertDigestChunks, slicesDigestChunks, type DigestTensor } from "./digest_core.js";

export * from "./digest_core.js";

function sha256(chunks: Uint8Array[]): Uint8Array {
  const h = createHash("sha256");
  for (const c of chunks) h.update(c);
  return new Uint8Array(h.digest());
}

/** sha256 over (dtype name, NUL, u64le dims, bytes) of gate_up [2I, H], then of down [H, I]
 * (as stored: [H, 2I] and [I, H] when transposed), then, where the experts have biases, of
 * gate_up_bias [2I] and down_bias [H] (PROTOCOL.md 12). */
export function expertDigest(...tensors: DigestTensor[]): Uint8Array {
  return sha256(expertDigestChunks(...tensors));
}

/** The digest a worker announces over `digests` (key: [layer, expert]), by ascending (layer, expert). */
export function slicesDigest(digests: Iterable<[[number, number], Uint8Array]>): Uint8Array {
  return sha256(slicesDigestChunks(digests));
}
