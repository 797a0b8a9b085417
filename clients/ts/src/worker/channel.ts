// The end-to-end channel (PROTOCOL.md 4.5): X25519, HKDF-SHA256, ChaCha20-Poly1305 or
// AES-256-GCM, all from node:crypto; the rest (names, nonces, kinds, the sealed heartbeat's
// bookkeeping) is channel_core.ts's, shared with the browser worker.

import {
  createCipheriv,
  createDecipheriv,
  createPrivateKey,
  createPublicKey,
  diffieHellman,
  generateKeyPairSync,
  hkdfSync,
  type KeyObject,
} from "node:crypto";

import { ascii, asBuffer, CloseCode, equalBytes, ProtocolError, utf8 } from "./bytes.js";
import {
  AEAD_NAMES,
  heartbeatPayload,
  interpretOpened,
  sealNonce,
  SEALED_CONTROL,
  SEALED_DATA,
  SEALED_HEARTBEAT,
  SEALED_HEARTBEAT_ACK,
  TAG_BYTES,
  tagFailure,
  tunnelKeysInfo,
  unopenable,
  type Opened,
} from "./channel_core.js";

export * from "./channel_core.js";

const X25519_PKCS8_PREFIX = Buffer.from("302e020100300506032b656e04220420", "hex");
const X25519_SPKI_PREFIX = Buffer.from("302a300506032b656e032100", "hex");

/** One side's ephemeral X25519 key pair (fresh unless `priv`, 32 bytes, is given: the vectors). */
export class KeyExchange {
  private readonly key: KeyObject;
  readonly publicKey: Uint8Array;

  constructor(priv?: Uint8Array) {
    this.key = priv
      ? createPrivateKey({ key: Buffer.concat([X25519_PKCS8_PREFIX, asBuffer(priv)]), format: "der", type: "pkcs8" })
      : generateKeyPairSync("x25519").privateKey;
    const spki = createPublicKey(this.key).export({ format: "der", type: "spki" });
    this.publicKey = new Uint8Array(spki.subarray(spki.length - 32));
  }

  /** X25519 with the peer's public key; ProtocolError 1008 for a key that is not 32 bytes or gives the all-zero secret. */
  sharedSecret(peer: Uint8Array): Uint8Array {
    if (peer.byteLength !== 32) {
      throw new ProtocolError(CloseCode.POLICY_VIOLATION, `key exchange: the peer's public key must be 32 bytes, got ${peer.byteLength}`);
    }
    let shared: Uint8Array;
    try {
      const pub = createPublicKey({ key: Buffer.concat([X25519_SPKI_PREFIX, asBuffer(peer)]), format: "der", type: "spki" });
      shared = new Uint8Array(diffieHellman({ privateKey: this.key, publicKey: pub }));
    } catch {
      shared = new Uint8Array(32); // OpenSSL refuses a low-order point: the same as an all-zero secret
    }
    if (equalBytes(shared, new Uint8Array(32))) {
      throw new ProtocolError(CloseCode.POLICY_VIOLATION, "key exchange: the peer's public key gives an all-zero shared secret (a low-order point)");
    }
    return shared;
  }
}

/** [hub -> worker key, worker -> hub key] from the X25519 secret and the transcript hash, for `aead`. */
export function deriveTunnelKeys(shared: Uint8Array, transcript: Uint8Array, aead: number): [Uint8Array, Uint8Array] {
  const okm = new Uint8Array(hkdfSync("sha256", shared, transcript, ascii(tunnelKeysInfo(aead)), 64));
  return [okm.slice(0, 32), okm.slice(32, 64)];
}

function nonce(counter: bigint): Buffer {
  return asBuffer(sealNonce(counter));
}

/** Seals what this side sends and opens what it receives; each direction has its own key and counter. */
export class TunnelCipher {
  private sent = 0n;
  private received = 0n;
  private broken = false;
  private readonly algo: "chacha20-poly1305" | "aes-256-gcm";

  constructor(
    private readonly sendKey: Uint8Array,
    private readonly receiveKey: Uint8Array,
    readonly aead: number,
    private readonly peer: string,
  ) {
    const name = AEAD_NAMES[aead];
    if (name !== "chacha20-poly1305" && name !== "aes-256-gcm") throw new Error(`unknown AEAD ${aead}`);
    this.algo = name;
  }

  /** The worker's cipher from [hub -> worker, worker -> hub] keys. */
  static forWorker(keys: [Uint8Array, Uint8Array], aead: number): TunnelCipher {
    return new TunnelCipher(keys[1], keys[0], aead, "hub");
  }

  /** The hub's cipher (tests). */
  static forHub(keys: [Uint8Array, Uint8Array], aead: number): TunnelCipher {
    return new TunnelCipher(keys[0], keys[1], aead, "worker");
  }

  private sealRaw(kind: number, payload: Uint8Array): Uint8Array {
    const c = createCipheriv(this.algo as "chacha20-poly1305", asBuffer(this.sendKey), nonce(this.sent), { authTagLength: TAG_BYTES });
    const body = Buffer.concat([c.update(Buffer.from([kind])), c.update(asBuffer(payload)), c.final(), c.getAuthTag()]);
    this.sent += 1n;
    return new Uint8Array(body.buffer, body.byteOffset, body.byteLength);
  }

  sealData(data: Uint8Array): Uint8Array {
    return this.sealRaw(SEALED_DATA, data);
  }

  sealControl(word: string): Uint8Array {
    return this.sealRaw(SEALED_CONTROL, utf8(word));
  }

  sealHeartbeat(seq: bigint, ack: boolean): Uint8Array {
    return this.sealRaw(ack ? SEALED_HEARTBEAT_ACK : SEALED_HEARTBEAT, heartbeatPayload(seq));
  }

  private fail(why: string): ProtocolError {
    this.broken = true;
    return new ProtocolError(CloseCode.POLICY_VIOLATION, why);
  }

  /** Open one received message (`string` for a text message); ProtocolError 1008 when it does not open. */
  open(message: Uint8Array | string): Opened {
    if (this.broken) throw this.fail("the end-to-end channel already failed");
    const why = unopenable(message, this.peer);
    if (why !== undefined) throw this.fail(why);
    const sealed = message as Uint8Array;
    let plain: Buffer;
    try {
      const d = createDecipheriv(this.algo as "chacha20-poly1305", asBuffer(this.receiveKey), nonce(this.received), { authTagLength: TAG_BYTES });
      const buf = asBuffer(sealed);
      d.setAuthTag(buf.subarray(buf.length - TAG_BYTES));
      plain = Buffer.concat([d.update(buf.subarray(0, buf.length - TAG_BYTES)), d.final()]);
    } catch {
      throw this.fail(tagFailure(this.received, this.peer));
    }
    this.received += 1n;
    return interpretOpened(new Uint8Array(plain.buffer, plain.byteOffset, plain.byteLength), (why) => this.fail(why));
  }
}
