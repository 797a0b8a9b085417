// The wallet (PROTOCOL.md 4.4) and the worker's side of the session handshake (4.1 to 4.3),
// signed and hashed with node:crypto; what the messages hold is handshake_core.ts's (no Node
// API), shared with the browser worker (clients/web).

import { createHash, createPrivateKey, createPublicKey, randomBytes, sign, verify, type KeyObject } from "node:crypto";
import { closeSync, existsSync, mkdirSync, openSync, readFileSync, statSync, writeSync } from "node:fs";
import { dirname } from "node:path";

import type { SessionChallenge } from "../gen/kvasir/v1/session_pb.js";
import { asBuffer, fromHex, toHex } from "./bytes.js";
import { deriveTunnelKeys, KeyExchange, TunnelCipher } from "./channel.js";
import {
  acceptSignedMessage,
  badAccept,
  badSignature,
  checkAeadsOffered,
  helloBody,
  helloMessage,
  helloSignedMessage,
  isAddress,
  parseAccept,
  parseChallenge,
  transcriptMessage,
  type HandshakeOptions,
  type HelloFacts,
} from "./handshake_core.js";

export * from "./handshake_core.js";

const ED25519_PKCS8_PREFIX = Buffer.from("302e020100300506032b657004220420", "hex");
const ED25519_SPKI_PREFIX = Buffer.from("302a300506032b6570032100", "hex");

/** An Ed25519 key pair; its address is the public key as 64 lowercase hex characters. */
export class Wallet {
  private readonly key: KeyObject;
  readonly address: string;

  constructor(readonly seed: Uint8Array) {
    if (seed.byteLength !== 32) throw new Error("an Ed25519 seed is 32 bytes");
    this.key = createPrivateKey({ key: Buffer.concat([ED25519_PKCS8_PREFIX, asBuffer(seed)]), format: "der", type: "pkcs8" });
    const spki = createPublicKey(this.key).export({ format: "der", type: "spki" });
    this.address = spki.subarray(spki.length - 32).toString("hex");
  }

  /** The 64-byte Ed25519 signature of `message` (RFC 8032, pure). */
  sign(message: Uint8Array): Uint8Array {
    return new Uint8Array(sign(null, message, this.key));
  }

  /** Read a wallet file (the 32-byte seed as 64 lowercase hex characters and a newline). */
  static load(path: string): Wallet {
    const text = readFileSync(path, "ascii").trim();
    if (!isAddress(text)) throw new Error(`${path}: expected 64 lowercase hex characters (an Ed25519 seed)`);
    const mode = statSync(path).mode & 0o077;
    if (mode !== 0) console.error(`warning: ${path}: the wallet key file is readable by others (chmod 600 it)`);
    return new Wallet(fromHex(text));
  }

  /** Load the wallet at `path`, creating it (mode 0600, parent folders too) when missing. */
  static loadOrCreate(path: string): Wallet {
    if (existsSync(path)) return Wallet.load(path);
    mkdirSync(dirname(path), { recursive: true, mode: 0o700 });
    const seed = new Uint8Array(randomBytes(32));
    let fd: number;
    try {
      fd = openSync(path, "wx", 0o600);
    } catch (exc) {
      if ((exc as NodeJS.ErrnoException).code === "EEXIST") return Wallet.load(path);
      throw exc;
    }
    try {
      writeSync(fd, `${toHex(seed)}\n`);
    } finally {
      closeSync(fd);
    }
    return new Wallet(seed);
  }
}

/** Check an Ed25519 signature by `address` (64 lowercase hex). Never throws on bad input. */
export function verifySignature(address: string, message: Uint8Array, signature: Uint8Array): boolean {
  if (!isAddress(address) || signature.byteLength !== 64) return false;
  try {
    const key = createPublicKey({ key: Buffer.concat([ED25519_SPKI_PREFIX, Buffer.from(address, "hex")]), format: "der", type: "spki" });
    return verify(null, message, key, signature);
  } catch {
    return false;
  }
}

/** sha256(u32be(len C) || C || u32be(len H) || H): the challenge and the hello exactly as sent. */
export function transcriptHash(challenge: Uint8Array, hello: Uint8Array): Uint8Array {
  return new Uint8Array(createHash("sha256").update(transcriptMessage(challenge, hello)).digest());
}

/** What the worker announces in its hello (4.2). */
export interface HelloInfo extends HelloFacts {
  wallet: Wallet;
}

export interface Accepted {
  sessionId: string;
  encrypted: boolean;
  aead: number;
  cipher: TunnelCipher | undefined;
  hubKey: string;
}

/** The worker's handshake: `receiveChallenge(bytes)` gives the hello's bytes; `receiveAccept(bytes)` the session. */
export class WorkerHandshake {
  private readonly kx: KeyExchange;
  private challenge: Uint8Array | undefined;
  private hello: Uint8Array | undefined;
  private hubKx: Uint8Array = new Uint8Array(0);
  private hubKey = "";

  constructor(
    private readonly info: HelloInfo,
    private readonly opts: HandshakeOptions,
  ) {
    this.kx = new KeyExchange(opts.kxPrivate);
    checkAeadsOffered(opts.aeads);
  }

  /** The SessionHello's bytes for the challenge `data`; ProtocolError with the close code to use. */
  receiveChallenge(data: Uint8Array): Uint8Array {
    if (this.challenge) throw new Error("receiveChallenge called twice");
    const ch: SessionChallenge = parseChallenge(data, this.opts);
    this.hubKey = ch.hubKey;
    this.hubKx = ch.kxPublic;
    const body = helloBody(this.info, this.info.wallet.address, ch, this.kx.publicKey, this.opts);
    const signature = this.info.wallet.sign(helloSignedMessage(body));
    this.challenge = data;
    this.hello = helloMessage(body, signature);
    return this.hello;
  }

  /** Check the SessionAccept `data`; ProtocolError with the close code to use. */
  receiveAccept(data: Uint8Array): Accepted {
    if (!this.challenge || !this.hello) throw new Error("receiveAccept before receiveChallenge");
    const { msg, aead } = parseAccept(data);
    const transcript = transcriptHash(this.challenge, this.hello);
    if (!verifySignature(this.hubKey, acceptSignedMessage(transcript, msg.sessionId, msg.encrypted, aead), msg.signature)) {
      throw badSignature(this.hubKey);
    }
    const bad = badAccept(msg, aead, this.opts, this.hubKx);
    if (bad) throw bad;
    let cipher: TunnelCipher | undefined;
    if (msg.encrypted) {
      const shared = this.kx.sharedSecret(this.hubKx);
      cipher = TunnelCipher.forWorker(deriveTunnelKeys(shared, transcript, aead), aead);
    }
    return { sessionId: msg.sessionId, encrypted: msg.encrypted, aead, cipher, hubKey: this.hubKey };
  }

  /** The hash of the challenge and hello as sent (after receiveChallenge). */
  transcript(): Uint8Array {
    if (!this.challenge || !this.hello) throw new Error("no transcript yet");
    return transcriptHash(this.challenge, this.hello);
  }
}
