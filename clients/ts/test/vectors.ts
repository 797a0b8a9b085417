// The repository's shared vectors (tests/vectors/*.json) for the Node tests: the JSON of one,
// and the worker's handshake of handshake.json (its wallet, hello and key exchange key).
import { readFileSync } from "node:fs";
import { join } from "node:path";

import { fromHex } from "../src/worker/bytes.js";
import { Wallet, WorkerHandshake } from "../src/worker/handshake.js";

export const VECTORS = join(import.meta.dirname, "..", "..", "..", "tests", "vectors");

// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type Json = any;

/** tests/vectors/NAME.json. */
export function vectors(name: string): Json {
  return JSON.parse(readFileSync(join(VECTORS, `${name}.json`), "utf8"));
}

/** The worker's side of handshake.json's handshake, offering `aeads`. */
export function vectorHandshake(h: Json, aeads: number[] = []): WorkerHandshake {
  const wallet = new Wallet(fromHex(h.wallet_seed_hex));
  return new WorkerHandshake(
    {
      wallet,
      slices: new Map((h.hello.slices as { layer: number; experts: number[] }[]).map((s) => [s.layer, s.experts])),
      weightsDigest: fromHex(h.hello.weights_digest_hex),
      device: h.hello.device,
      modelType: h.hello.model_type,
      workerVersion: h.hello.worker_version,
      projections: Boolean(h.hello.projections),
    },
    { requireEncryption: h.hello.require_encryption, aeads, kxPrivate: fromHex(h.worker_kx_private_hex) },
  );
}
