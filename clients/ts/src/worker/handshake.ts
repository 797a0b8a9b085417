// The wallet (PROTOCOL.md 4.4) and the worker's side of the session handshake (4.1 to 4.3).

import { createHash, createPrivateKey, createPublicKey, randomBytes, sign, verify, type KeyObject } from "node:crypto";
import { closeSync, existsSync, mkdirSync, openSync, readFileSync, statSync, writeSync } from "node:fs";
import { dirname } from "node:path";

import { create, fromBinary, toBinary, type MessageInitShape } from "@bufbuild/protobuf";

import {
  ExpertSliceSchema,
  HelloBodySchema,
  SessionAcceptSchema,
  SessionChallengeSchema,
  SessionHelloSchema,
} from "../gen/kvasir/v1/session_pb.js";
import { ascii, asBuffer, CloseCode, concat, fromHex, ProtocolError, toHex, u32be, utf8 } from "./bytes.js";
import { AEAD_CHACHA20_POLY1305, AEAD_NAMES, deriveTunnelKeys, KeyExchange, TunnelCipher } from "./channel.js";

export const HELLO_SIGNATURE_DOMAIN = ascii("kvasir.v1.SessionHello\0");
export const ACCEPT_SIGNATURE_DOMAIN = ascii("kvasir.v1.SessionAccept\0");
export const ACCEPT_AEAD_SIGNATURE_DOMAIN = ascii("kvasir.v1.SessionAccept.aead\0");
export const NONCE_BYTES = 32;
export const MAX_SESSION_ID_CHARS = 128;
export const MAX_AEADS_OFFERED = 16;

const ED25519_PKCS8_PREFIX = Buffer.from("302e020100300506032b657004220420", "hex");
const ED25519_SPKI_PREFIX = Buffer.from("302a300506032b6570032100", "hex");
const ADDRESS = /^[0-9a-f]{64}$/;

export function isAddress(text: string): boolean {
  return ADDRESS.test(text);
}

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
  const h = createHash("sha256");
  h.update(u32be(challenge.byteLength));
  h.update(challenge);
  h.update(u32be(hello.byteLength));
  h.update(hello);
  return new Uint8Array(h.digest());
}

/** The bytes the hub's accept signature covers (4.3), for the accept's `aead`. */
export function acceptSignedMessage(transcript: Uint8Array, sessionId: string, encrypted: boolean, aead: number): Uint8Array {
  const e = new Uint8Array([encrypted ? 1 : 0]);
  if (aead === AEAD_CHACHA20_POLY1305) return concat(ACCEPT_SIGNATURE_DOMAIN, transcript, utf8(sessionId), e);
  return concat(ACCEPT_AEAD_SIGNATURE_DOMAIN, transcript, new Uint8Array([aead]), e, utf8(sessionId));
}

/** What the worker announces in its hello (4.2). */
export interface HelloInfo {
  wallet: Wallet;
  slices: Map<number, number[]>;
  weightsDigest: Uint8Array;
  device: string;
  modelType: string;
  workerVersion: string;
  projections: boolean;
  /** Extra HelloBody fields (e.g. the expert function), set as they are. */
  extra?: Omit<MessageInitShape<typeof HelloBodySchema>, "$typeName">;
}

export interface HandshakeOptions {
  /** The pinned hub key (--hub-key): a challenge from another is refused. */
  expectedHubKey?: string | undefined;
  /** Refuse a session that is not encrypted end to end. */
  requireEncryption: boolean;
  /** AEADs offered besides the default, most preferred first. */
  aeads: number[];
  /** The ephemeral X25519 private key (tests); fresh otherwise. */
  kxPrivate?: Uint8Array;
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
    if (opts.aeads.length > MAX_AEADS_OFFERED || opts.aeads.some((a) => a === AEAD_CHACHA20_POLY1305 || !(a in AEAD_NAMES))) {
      throw new Error(`aeads: offer at most ${MAX_AEADS_OFFERED} of ${Object.values(AEAD_NAMES).slice(1).join(", ")}`);
    }
  }

  /** The SessionHello's bytes for the challenge `data`; ProtocolError with the close code to use. */
  receiveChallenge(data: Uint8Array): Uint8Array {
    if (this.challenge) throw new Error("receiveChallenge called twice");
    let ch;
    try {
      ch = fromBinary(SessionChallengeSchema, data);
    } catch (exc) {
      throw new ProtocolError(CloseCode.PROTOCOL_ERROR, `not a SessionChallenge: ${exc instanceof Error ? exc.message : String(exc)}`);
    }
    if (ch.nonce.byteLength !== NONCE_BYTES) {
      throw new ProtocolError(CloseCode.PROTOCOL_ERROR, `challenge nonce must be ${NONCE_BYTES} bytes, got ${ch.nonce.byteLength}`);
    }
    if (!isAddress(ch.hubKey)) throw new ProtocolError(CloseCode.PROTOCOL_ERROR, "challenge hub_key must be 64 lowercase hex characters");
    const pinned = this.opts.expectedHubKey;
    if (pinned !== undefined && ch.hubKey !== pinned) {
      throw new ProtocolError(CloseCode.HUB_KEY_MISMATCH, `unexpected hub key ${ch.hubKey.slice(0, 16)}…: this worker pins ${pinned.slice(0, 16)}… (--hub-key)`);
    }
    if (ch.kxPublic.byteLength !== 0 && ch.kxPublic.byteLength !== 32) {
      throw new ProtocolError(CloseCode.POLICY_VIOLATION, `challenge kx_public must be 32 bytes, got ${ch.kxPublic.byteLength}`);
    }
    if (this.opts.requireEncryption && ch.kxPublic.byteLength === 0) {
      throw new ProtocolError(CloseCode.E2E_MISMATCH, "the hub offers no end-to-end encryption (no key exchange in its challenge) and this worker requires it (--e2e require)");
    }
    this.hubKey = ch.hubKey;
    this.hubKx = ch.kxPublic;
    const i = this.info;
    const body = toBinary(
      HelloBodySchema,
      create(HelloBodySchema, {
        nonce: ch.nonce,
        hubKey: ch.hubKey,
        wallet: i.wallet.address,
        slices: [...i.slices].sort((a, b) => a[0] - b[0]).map(([layer, experts]) => create(ExpertSliceSchema, { layer, experts })),
        weightsDigest: i.weightsDigest,
        device: i.device,
        modelType: i.modelType,
        workerVersion: i.workerVersion,
        kxPublic: this.kx.publicKey,
        hubKxPublic: ch.kxPublic,
        requireEncryption: this.opts.requireEncryption,
        aeads: this.opts.aeads,
        projections: i.projections,
        ...(i.extra ?? {}),
      }),
    );
    const signature = i.wallet.sign(concat(HELLO_SIGNATURE_DOMAIN, body));
    this.challenge = data;
    this.hello = toBinary(SessionHelloSchema, create(SessionHelloSchema, { body, signature }));
    return this.hello;
  }

  /** Check the SessionAccept `data`; ProtocolError with the close code to use. */
  receiveAccept(data: Uint8Array): Accepted {
    if (!this.challenge || !this.hello) throw new Error("receiveAccept before receiveChallenge");
    let msg;
    try {
      msg = fromBinary(SessionAcceptSchema, data);
    } catch (exc) {
      throw new ProtocolError(CloseCode.PROTOCOL_ERROR, `not a SessionAccept: ${exc instanceof Error ? exc.message : String(exc)}`);
    }
    // "1 to 128 characters": counted as Unicode code points, as Python's len() counts them.
    const chars = [...msg.sessionId].length;
    if (chars === 0 || chars > MAX_SESSION_ID_CHARS) {
      throw new ProtocolError(CloseCode.PROTOCOL_ERROR, `accept: session_id must be 1 to ${MAX_SESSION_ID_CHARS} characters`);
    }
    if (msg.signature.byteLength === 0) {
      throw new ProtocolError(CloseCode.POLICY_VIOLATION, "accept: not signed by the hub (a hub too old for this worker, or a relay that stripped the signature)");
    }
    const aead = Number(msg.aead);
    if (!(aead in AEAD_NAMES)) throw new ProtocolError(CloseCode.POLICY_VIOLATION, `accept: unknown tunnel AEAD ${aead}, which this worker did not offer`);
    const transcript = transcriptHash(this.challenge, this.hello);
    if (!verifySignature(this.hubKey, acceptSignedMessage(transcript, msg.sessionId, msg.encrypted, aead), msg.signature)) {
      throw new ProtocolError(CloseCode.POLICY_VIOLATION, `accept: bad signature (not hub ${this.hubKey.slice(0, 16)}… over this connection's handshake)`);
    }
    if (aead !== AEAD_CHACHA20_POLY1305 && (!this.opts.aeads.includes(aead) || !msg.encrypted)) {
      throw new ProtocolError(
        CloseCode.POLICY_VIOLATION,
        msg.encrypted ? `accept: tunnel AEAD ${AEAD_NAMES[aead]}, which this worker did not offer` : "accept: an AEAD named for a tunnel that is not encrypted",
      );
    }
    let cipher: TunnelCipher | undefined;
    if (msg.encrypted) {
      if (this.hubKx.byteLength === 0) throw new ProtocolError(CloseCode.POLICY_VIOLATION, "accept: encrypted, but the challenge had no key exchange");
      const shared = this.kx.sharedSecret(this.hubKx);
      cipher = TunnelCipher.forWorker(deriveTunnelKeys(shared, transcript, aead), aead);
    } else if (this.opts.requireEncryption) {
      throw new ProtocolError(CloseCode.E2E_MISMATCH, "accept: the hub did not encrypt this session and this worker requires it (--e2e require)");
    }
    return { sessionId: msg.sessionId, encrypted: msg.encrypted, aead, cipher, hubKey: this.hubKey };
  }

  /** The hash of the challenge and hello as sent (after receiveChallenge). */
  transcript(): Uint8Array {
    if (!this.challenge || !this.hello) throw new Error("no transcript yet");
    return transcriptHash(this.challenge, this.hello);
  }
}
