// The page's cryptography (src/crypto.ts, src/handshake.ts, src/wallet.ts: WebCrypto) against
// tests/vectors/handshake.json and channel.json, run in the browser by tests/test_web_worker.py
// (bundled by esbuild, imported by the page, `run(vectors)` evaluated): every byte the Node
// worker's tests check (clients/ts/test/worker.test.ts) that a browser worker produces.

import { fromBinary, toBinary } from "@bufbuild/protobuf";

import { SessionAcceptSchema, SessionHelloSchema } from "../../ts/src/gen/kvasir/v1/session_pb.js";
import { fromHex, ProtocolError, toHex, utf8 } from "../../ts/src/worker/bytes_core.js";
import { AEAD_AES_256_GCM } from "../../ts/src/worker/channel_core.js";
import { acceptSignedMessage } from "../../ts/src/worker/handshake_core.js";
import { deriveTunnelKeys, ed25519Verify, WebCipher, WebKeyExchange } from "../src/crypto.js";
import { WebHandshake } from "../src/handshake.js";
import { WebWallet } from "../src/wallet.js";

// eslint-disable-next-line @typescript-eslint/no-explicit-any -- parsed JSON of known shape
type Json = any;

function hello(h: Json): Json {
  return {
    slices: new Map((h.hello.slices as { layer: number; experts: number[] }[]).map((s) => [s.layer, s.experts])),
    weightsDigest: fromHex(h.hello.weights_digest_hex),
    device: h.hello.device,
    modelType: h.hello.model_type,
    workerVersion: h.hello.worker_version,
    projections: Boolean(h.hello.projections),
  };
}

async function closeCode(fn: () => Promise<unknown>): Promise<number | string> {
  try {
    await fn();
  } catch (exc) {
    return exc instanceof ProtocolError ? exc.code : String(exc);
  }
  return "not refused";
}

/** Every check that fails, as a line; empty when all pass. */
export async function run(v: { handshake: Json; channel: Json }): Promise<string[]> {
  const failed: string[] = [];
  const eq = (what: string, got: unknown, want: unknown): void => {
    if (got !== want) failed.push(`${what}: got ${String(got)}, want ${String(want)}`);
  };
  const h = v.handshake;
  const c = v.channel;
  const wallet = await WebWallet.fromSeed(fromHex(h.wallet_seed_hex));
  eq("wallet address", wallet.address, h.wallet_address);
  eq("key file", wallet.keyFile(), `${h.wallet_seed_hex}\n`);
  eq("key file round trip", (await WebWallet.fromKeyFile(wallet.keyFile())).address, h.wallet_address);
  const kx = await WebKeyExchange.create(fromHex(h.worker_kx_private_hex));
  eq("X25519 public key", toHex(kx.publicKey), h.worker_kx_public_hex);
  eq("X25519 shared secret", toHex(await kx.sharedSecret(fromHex(c.hub_kx_public_hex))), c.shared_secret_hex);
  eq("an all-zero peer key", await closeCode(() => kx.sharedSecret(new Uint8Array(32))), 1008);

  // The hello's exact bytes (Ed25519 is deterministic), as the vectors offered no AEAD.
  const kxPrivate = fromHex(h.worker_kx_private_hex);
  const opts = { requireEncryption: h.hello.require_encryption, aeads: [], kxPrivate };
  const hs = await WebHandshake.create(hello(h), wallet, opts);
  const sent = await hs.receiveChallenge(fromHex(h.session_challenge_hex));
  const parsed = fromBinary(SessionHelloSchema, sent);
  eq("HelloBody bytes", toHex(parsed.body), h.hello_body_hex);
  eq("hello signature", toHex(parsed.signature), h.signature_hex);
  eq("SessionHello bytes", toHex(sent), h.session_hello_hex);
  const signedAccept = fromHex(h.accept_signed_message_hex);
  const accepted = await ed25519Verify(h.hub_key, signedAccept, fromHex(h.accept_signature_hex));
  eq("accept signature", accepted, true);
  // The vectors' accept seals with ChaCha20-Poly1305, which a browser has not: refused, 4103.
  const chacha = await closeCode(() => hs.receiveAccept(fromHex(h.session_accept_hex)));
  eq("a ChaCha20-Poly1305 accept", chacha, 4103);
  // One bit of the accept's signature flipped: 1008.
  const hs2 = await WebHandshake.create(hello(h), wallet, opts);
  await hs2.receiveChallenge(fromHex(h.session_challenge_hex));
  const acc = fromBinary(SessionAcceptSchema, fromHex(h.session_accept_hex));
  acc.signature = Uint8Array.from(acc.signature, (b: number, i: number) => (i === 0 ? b ^ 1 : b));
  const flippedAccept = toBinary(SessionAcceptSchema, acc);
  eq("a flipped signature bit", await closeCode(() => hs2.receiveAccept(flippedAccept)), 1008);

  // AES-256-GCM: the accept's signed form, the keys, every sealed message each way.
  const a = c.aes_256_gcm;
  const transcript = fromHex(c.transcript_hash_hex);
  const signed = acceptSignedMessage(transcript, a.session_id, true, AEAD_AES_256_GCM);
  eq("AES accept signed bytes", toHex(signed), a.accept_signed_message_hex);
  const keys = await deriveTunnelKeys(fromHex(c.shared_secret_hex), transcript, AEAD_AES_256_GCM);
  eq("hub -> worker key", toHex(keys[0]), a.hub_to_worker_key_hex);
  eq("worker -> hub key", toHex(keys[1]), a.worker_to_hub_key_hex);
  const cipher = await WebCipher.forWorker(keys);
  for (const m of a.messages as Json[]) {
    const payload = fromHex(m.payload_hex);
    if (m.from === "hub") {
      const opened = await cipher.open(fromHex(m.sealed_hex));
      eq(`hub message ${m.counter} kind`, opened.kind === "ack" ? "heartbeat_ack" : opened.kind, m.kind);
      if (opened.kind === "data") eq(`hub message ${m.counter}`, toHex(opened.data), m.payload_hex);
      if (opened.kind === "control") eq(`hub message ${m.counter}`, toHex(utf8(opened.word)), m.payload_hex);
      if (opened.kind === "heartbeat" || opened.kind === "ack") {
        eq(`hub message ${m.counter}`, opened.seq, new DataView(payload.buffer).getBigUint64(0, false));
      }
    } else {
      let sealed: Uint8Array;
      if (m.kind === "data") sealed = await cipher.sealData(payload);
      else if (m.kind === "control") sealed = await cipher.sealControl(new TextDecoder().decode(payload));
      else {
        const seq = new DataView(payload.buffer).getBigUint64(0, false);
        sealed = await cipher.sealHeartbeat(seq, m.kind === "heartbeat_ack");
      }
      eq(`worker message ${m.counter}`, toHex(sealed), m.sealed_hex);
    }
  }
  // A replayed or altered message: 1008.
  const first = fromHex((a.messages as Json[]).find((m) => m.from === "hub").sealed_hex);
  const fresh = await WebCipher.forWorker(keys);
  await fresh.open(first);
  eq("a replay", await closeCode(() => fresh.open(first)), 1008);
  const flipped = Uint8Array.from(first, (b, i) => (i === 3 ? b ^ 0x10 : b));
  eq("a flipped bit", await closeCode(async () => (await WebCipher.forWorker(keys)).open(flipped)), 1008);
  eq("a text message", await closeCode(async () => (await WebCipher.forWorker(keys)).open("open")), 1008);
  return failed;
}
