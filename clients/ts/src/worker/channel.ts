// The end-to-end channel (PROTOCOL.md 4.5): X25519, HKDF-SHA256, ChaCha20-Poly1305 or
// AES-256-GCM, all from node:crypto; and the sealed heartbeat's bookkeeping.

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

import { ascii, asBuffer, CloseCode, equalBytes, LocalProtocolError, ProtocolError, utf8 } from "./bytes.js";

/** TunnelAead wire values (session.proto). */
export const AEAD_CHACHA20_POLY1305 = 0;
export const AEAD_AES_256_GCM = 1;
export const AEAD_NAMES: Record<number, string> = { 0: "chacha20-poly1305", 1: "aes-256-gcm" };

export const TUNNEL_KEYS_INFO = "kvasir.v1.tunnel keys";
export const SEALED_DATA = 0;
export const SEALED_CONTROL = 1;
export const SEALED_HEARTBEAT = 2;
export const SEALED_HEARTBEAT_ACK = 3;
export const SEAL_OVERHEAD = 17;
const TAG_BYTES = 16;

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
  const info = aead === AEAD_CHACHA20_POLY1305 ? TUNNEL_KEYS_INFO : `${TUNNEL_KEYS_INFO} ${AEAD_NAMES[aead]}`;
  const okm = new Uint8Array(hkdfSync("sha256", shared, transcript, ascii(info), 64));
  return [okm.slice(0, 32), okm.slice(32, 64)];
}

function nonce(counter: bigint): Buffer {
  const b = Buffer.alloc(12);
  b.writeBigUInt64BE(counter, 4);
  return b;
}

/** What a sealed message opened to. */
export type Opened =
  | { kind: "data"; data: Uint8Array }
  | { kind: "control"; word: string }
  | { kind: "heartbeat"; seq: bigint }
  | { kind: "ack"; seq: bigint };

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
    const b = Buffer.alloc(8);
    b.writeBigUInt64BE(seq);
    return this.sealRaw(ack ? SEALED_HEARTBEAT_ACK : SEALED_HEARTBEAT, b);
  }

  private fail(why: string): ProtocolError {
    this.broken = true;
    return new ProtocolError(CloseCode.POLICY_VIOLATION, why);
  }

  /** Open one received message (`string` for a text message); ProtocolError 1008 when it does not open. */
  open(message: Uint8Array | string): Opened {
    if (this.broken) throw this.fail("the end-to-end channel already failed");
    if (typeof message === "string") throw this.fail(`a text message on an encrypted tunnel: the ${this.peer} or a relay sent clear text`);
    if (message.byteLength < SEAL_OVERHEAD) throw this.fail(`a sealed message of ${message.byteLength} bytes is shorter than its ${SEAL_OVERHEAD} bytes of overhead`);
    let plain: Buffer;
    try {
      const d = createDecipheriv(this.algo as "chacha20-poly1305", asBuffer(this.receiveKey), nonce(this.received), { authTagLength: TAG_BYTES });
      const buf = asBuffer(message);
      d.setAuthTag(buf.subarray(buf.length - TAG_BYTES));
      plain = Buffer.concat([d.update(buf.subarray(0, buf.length - TAG_BYTES)), d.final()]);
    } catch {
      throw this.fail(`message ${this.received} from the ${this.peer} failed its authentication tag: altered, replayed, reordered or dropped on the way`);
    }
    this.received += 1n;
    const kind = plain[0];
    const payload = new Uint8Array(plain.buffer, plain.byteOffset + 1, plain.byteLength - 1);
    switch (kind) {
      case SEALED_DATA:
        return { kind: "data", data: payload };
      case SEALED_CONTROL: {
        let word: string;
        try {
          word = new TextDecoder("utf-8", { fatal: true }).decode(payload);
        } catch {
          throw this.fail("a sealed control message is not UTF-8");
        }
        return { kind: "control", word };
      }
      case SEALED_HEARTBEAT:
      case SEALED_HEARTBEAT_ACK: {
        const name = kind === SEALED_HEARTBEAT ? "heartbeat" : "heartbeat ack";
        if (payload.byteLength !== 8) throw this.fail(`a sealed ${name} carries ${payload.byteLength} bytes, not its 8-byte sequence number`);
        const seq = Buffer.from(payload).readBigUInt64BE(0);
        return kind === SEALED_HEARTBEAT ? { kind: "heartbeat", seq } : { kind: "ack", seq };
      }
      default:
        throw this.fail(`a sealed message of unknown kind ${kind} (0: data, 1: control, 2: heartbeat, 3: heartbeat ack)`);
    }
  }
}

/** The sending side of the sealed heartbeat: numbers heartbeats 0, 1, 2, ... and checks each ack. */
export class HeartbeatMonitor {
  private next = 0n;
  waiting: bigint | undefined;

  /** The next heartbeat's number; LocalProtocolError while the last is unanswered. */
  beat(): bigint {
    if (this.waiting !== undefined) throw new LocalProtocolError(`heartbeat ${this.waiting} is still waiting for its answer`);
    this.waiting = this.next;
    this.next += 1n;
    return this.waiting;
  }

  /** An ack from the peer; ProtocolError 1008 unless it answers the heartbeat waiting. */
  receiveAck(seq: bigint): void {
    if (this.waiting === undefined) {
      throw new ProtocolError(CloseCode.POLICY_VIOLATION, `the hub acknowledged heartbeat ${seq}, but no heartbeat is waiting for an answer`);
    }
    if (seq !== this.waiting) {
      throw new ProtocolError(CloseCode.POLICY_VIOLATION, `the hub acknowledged heartbeat ${seq}, but heartbeat ${this.waiting} is the one waiting`);
    }
    this.waiting = undefined;
  }
}

