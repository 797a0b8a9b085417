// The worker's cryptography with WebCrypto (crypto.subtle): SHA-256, Ed25519 signatures (the
// wallet and the hub's accept), X25519, HKDF-SHA256 and AES-256-GCM for the end-to-end channel
// (PROTOCOL.md 4.4, 4.5). A browser has no ChaCha20-Poly1305, so this worker offers AES-256-GCM
// alone. Every operation is asynchronous; the channel keeps its messages in order (WebCipher).

import { CloseCode, concat, equalBytes, fromHex, ProtocolError, utf8 } from "../../ts/src/worker/bytes_core.js";
import {
  AEAD_AES_256_GCM,
  heartbeatPayload,
  interpretOpened,
  sealNonce,
  SEALED_CONTROL,
  SEALED_DATA,
  SEALED_HEARTBEAT,
  SEALED_HEARTBEAT_ACK,
  tagFailure,
  tunnelKeysInfo,
  unopenable,
  type Opened,
} from "../../ts/src/worker/channel_core.js";
import { isAddress } from "../../ts/src/worker/handshake_core.js";

const subtle = (): SubtleCrypto => {
  if (!globalThis.crypto?.subtle) {
    throw new Error("WebCrypto is unavailable: open the page over https:// or from localhost");
  }
  return globalThis.crypto.subtle;
};

/** WebCrypto wants ArrayBuffer-backed views: a copy when `b` is over another kind of buffer. */
function buf(b: Uint8Array): Uint8Array<ArrayBuffer> {
  return b.buffer instanceof ArrayBuffer ? (b as Uint8Array<ArrayBuffer>) : new Uint8Array(b);
}

export async function sha256(data: Uint8Array): Promise<Uint8Array> {
  return new Uint8Array(await subtle().digest("SHA-256", buf(data)));
}

/** SHA-256 over the concatenation of `chunks` (crypto.subtle hashes one buffer). */
export async function sha256Chunks(chunks: Uint8Array[]): Promise<Uint8Array> {
  return sha256(concat(...chunks));
}

const ED25519_PKCS8_PREFIX = fromHex("302e020100300506032b657004220420");
const X25519_PKCS8_PREFIX = fromHex("302e020100300506032b656e04220420");

/** Whether this browser's WebCrypto has Ed25519 and X25519 (Chromium 137+, Firefox 130+, Safari 17+). */
export async function cryptoSupport(): Promise<string | undefined> {
  try {
    await subtle().generateKey({ name: "Ed25519" }, false, ["sign"]);
  } catch (exc) {
    return `this browser's WebCrypto has no Ed25519 (${String(exc)})`;
  }
  try {
    await subtle().generateKey({ name: "X25519" }, false, ["deriveBits"]);
  } catch (exc) {
    return `this browser's WebCrypto has no X25519 (${String(exc)})`;
  }
  return undefined;
}

/** An Ed25519 signing key from its 32-byte seed, and its address (the public key, 64 hex). */
export async function ed25519FromSeed(seed: Uint8Array): Promise<{ key: CryptoKey; address: string }> {
  if (seed.byteLength !== 32) throw new Error("an Ed25519 seed is 32 bytes");
  const pkcs8 = buf(concat(ED25519_PKCS8_PREFIX, seed));
  const extractable = await subtle().importKey("pkcs8", pkcs8, { name: "Ed25519" }, true, ["sign"]);
  const jwk = await subtle().exportKey("jwk", extractable);
  const pub = base64url(jwk.x ?? "");
  if (pub.byteLength !== 32) throw new Error("WebCrypto gave no Ed25519 public key");
  const key = await subtle().importKey("pkcs8", pkcs8, { name: "Ed25519" }, false, ["sign"]);
  return { key, address: [...pub].map((b) => b.toString(16).padStart(2, "0")).join("") };
}

export async function ed25519Sign(key: CryptoKey, message: Uint8Array): Promise<Uint8Array> {
  return new Uint8Array(await subtle().sign({ name: "Ed25519" }, key, buf(message)));
}

/** Check an Ed25519 signature by `address` (64 lowercase hex). Never throws on bad input. */
export async function ed25519Verify(address: string, message: Uint8Array, signature: Uint8Array): Promise<boolean> {
  if (!isAddress(address) || signature.byteLength !== 64) return false;
  try {
    const key = await subtle().importKey("raw", buf(fromHex(address)), { name: "Ed25519" }, false, ["verify"]);
    return await subtle().verify({ name: "Ed25519" }, key, buf(signature), buf(message));
  } catch {
    return false;
  }
}

function base64url(text: string): Uint8Array {
  const b64 = text.replace(/-/g, "+").replace(/_/g, "/");
  const bin = atob(b64 + "===".slice((b64.length + 3) % 4));
  return Uint8Array.from(bin, (c) => c.charCodeAt(0));
}

/** One side's ephemeral X25519 key pair (fresh unless `priv`, 32 bytes, is given). */
export class WebKeyExchange {
  private constructor(
    private readonly key: CryptoKey,
    readonly publicKey: Uint8Array,
  ) {}

  static async create(priv?: Uint8Array): Promise<WebKeyExchange> {
    let key: CryptoKey;
    let pub: Uint8Array;
    if (priv) {
      const pkcs8 = buf(concat(X25519_PKCS8_PREFIX, priv));
      key = await subtle().importKey("pkcs8", pkcs8, { name: "X25519" }, true, ["deriveBits"]);
      pub = base64url((await subtle().exportKey("jwk", key)).x ?? "");
    } else {
      const pair = (await subtle().generateKey({ name: "X25519" }, false, ["deriveBits"])) as CryptoKeyPair;
      key = pair.privateKey;
      pub = new Uint8Array(await subtle().exportKey("raw", pair.publicKey));
    }
    return new WebKeyExchange(key, pub);
  }

  /** X25519 with the peer's public key; ProtocolError 1008 for a key that is not 32 bytes or
   * gives the all-zero secret. */
  async sharedSecret(peer: Uint8Array): Promise<Uint8Array> {
    if (peer.byteLength !== 32) {
      const why = `key exchange: the peer's public key must be 32 bytes, got ${peer.byteLength}`;
      throw new ProtocolError(CloseCode.POLICY_VIOLATION, why);
    }
    let shared: Uint8Array;
    try {
      const pub = await subtle().importKey("raw", buf(peer), { name: "X25519" }, false, []);
      shared = new Uint8Array(await subtle().deriveBits({ name: "X25519", public: pub }, this.key, 256));
    } catch {
      shared = new Uint8Array(32); // WebCrypto refuses a low-order point: the same as an all-zero secret
    }
    if (equalBytes(shared, new Uint8Array(32))) {
      const why = "key exchange: the peer's public key gives an all-zero shared secret (a low-order point)";
      throw new ProtocolError(CloseCode.POLICY_VIOLATION, why);
    }
    return shared;
  }
}

/** [hub -> worker key, worker -> hub key] from the X25519 secret and the transcript hash (HKDF-SHA256). */
export async function deriveTunnelKeys(
  shared: Uint8Array,
  transcript: Uint8Array,
  aead: number,
): Promise<[Uint8Array, Uint8Array]> {
  const ikm = await subtle().importKey("raw", buf(shared), "HKDF", false, ["deriveBits"]);
  const info = buf(utf8(tunnelKeysInfo(aead)));
  const params = { name: "HKDF", hash: "SHA-256", salt: buf(transcript), info };
  const okm = new Uint8Array(await subtle().deriveBits(params, ikm, 512));
  return [okm.slice(0, 32), okm.slice(32, 64)];
}

/** The worker's side of an AES-256-GCM tunnel. Each direction has its own key and counter; a
 * message's counter is taken when seal() or open() is called, so calls made in order give
 * results in that order whatever order WebCrypto finishes them in (callers await in order). */
export class WebCipher {
  private sent = 0n;
  private received = 0n;
  private broken = false;
  readonly aead = AEAD_AES_256_GCM;

  private constructor(
    private readonly sendKey: CryptoKey,
    private readonly receiveKey: CryptoKey,
  ) {}

  /** The worker's cipher from [hub -> worker, worker -> hub] keys. */
  static async forWorker(keys: [Uint8Array, Uint8Array]): Promise<WebCipher> {
    const imp = (k: Uint8Array, use: KeyUsage): Promise<CryptoKey> =>
      subtle().importKey("raw", buf(k), "AES-GCM", false, [use]);
    return new WebCipher(await imp(keys[1], "encrypt"), await imp(keys[0], "decrypt"));
  }

  private async sealRaw(kind: number, payload: Uint8Array): Promise<Uint8Array> {
    const iv = buf(sealNonce(this.sent));
    this.sent += 1n;
    const plain = new Uint8Array(1 + payload.byteLength);
    plain[0] = kind;
    plain.set(payload, 1);
    return new Uint8Array(await subtle().encrypt({ name: "AES-GCM", iv, tagLength: 128 }, this.sendKey, plain));
  }

  sealData(data: Uint8Array): Promise<Uint8Array> {
    return this.sealRaw(SEALED_DATA, data);
  }

  sealControl(word: string): Promise<Uint8Array> {
    return this.sealRaw(SEALED_CONTROL, utf8(word));
  }

  sealHeartbeat(seq: bigint, ack: boolean): Promise<Uint8Array> {
    return this.sealRaw(ack ? SEALED_HEARTBEAT_ACK : SEALED_HEARTBEAT, heartbeatPayload(seq));
  }

  private fail(why: string): ProtocolError {
    this.broken = true;
    return new ProtocolError(CloseCode.POLICY_VIOLATION, why);
  }

  /** Open one received message (`string` for a text message); ProtocolError 1008 when it does not open. */
  async open(message: Uint8Array | string): Promise<Opened> {
    if (this.broken) throw this.fail("the end-to-end channel already failed");
    const why = unopenable(message, "hub");
    if (why !== undefined) throw this.fail(why);
    const n = this.received;
    this.received += 1n;
    let plain: Uint8Array;
    try {
      const iv = buf(sealNonce(n));
      const params = { name: "AES-GCM", iv, tagLength: 128 };
      plain = new Uint8Array(await subtle().decrypt(params, this.receiveKey, buf(message as Uint8Array)));
    } catch {
      throw this.fail(tagFailure(n, "hub"));
    }
    return interpretOpened(plain, (w) => this.fail(w));
  }
}
