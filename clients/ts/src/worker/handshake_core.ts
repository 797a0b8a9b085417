// The worker's side of the session handshake (PROTOCOL.md 4.1 to 4.3) without its
// cryptography: what the challenge and accept must hold, the hello's body, the bytes each
// signature and the transcript hash cover. No Node API: handshake.ts signs and hashes with
// node:crypto, the browser worker (clients/web) with WebCrypto.

import { create, fromBinary, toBinary, type MessageInitShape } from "@bufbuild/protobuf";

import {
  ExpertSliceSchema,
  HelloBodySchema,
  SessionAcceptSchema,
  SessionChallengeSchema,
  SessionHelloSchema,
  type SessionAccept,
  type SessionChallenge,
} from "../gen/kvasir/v1/session_pb.js";
import { ascii, CloseCode, concat, ProtocolError, u32be, utf8 } from "./bytes_core.js";
import { AEAD_CHACHA20_POLY1305, AEAD_NAMES } from "./channel_core.js";

export const HELLO_SIGNATURE_DOMAIN = ascii("kvasir.v1.SessionHello\0");
export const ACCEPT_SIGNATURE_DOMAIN = ascii("kvasir.v1.SessionAccept\0");
export const ACCEPT_AEAD_SIGNATURE_DOMAIN = ascii("kvasir.v1.SessionAccept.aead\0");
export const NONCE_BYTES = 32;
export const MAX_SESSION_ID_CHARS = 128;
export const MAX_AEADS_OFFERED = 16;

const ADDRESS = /^[0-9a-f]{64}$/;

export function isAddress(text: string): boolean {
  return ADDRESS.test(text);
}

/** The bytes the transcript hash covers: u32be(len C) || C || u32be(len H) || H. */
export function transcriptMessage(challenge: Uint8Array, hello: Uint8Array): Uint8Array {
  return concat(u32be(challenge.byteLength), challenge, u32be(hello.byteLength), hello);
}

/** The bytes the hub's accept signature covers (4.3), for the accept's `aead`. */
export function acceptSignedMessage(
  transcript: Uint8Array,
  sessionId: string,
  encrypted: boolean,
  aead: number,
): Uint8Array {
  const e = new Uint8Array([encrypted ? 1 : 0]);
  if (aead === AEAD_CHACHA20_POLY1305) return concat(ACCEPT_SIGNATURE_DOMAIN, transcript, utf8(sessionId), e);
  return concat(ACCEPT_AEAD_SIGNATURE_DOMAIN, transcript, new Uint8Array([aead]), e, utf8(sessionId));
}

/** What the worker announces in its hello (4.2), but its wallet. */
export interface HelloFacts {
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

/** Throws unless `aeads` is a list a hello may offer (4.2). */
export function checkAeadsOffered(aeads: number[]): void {
  if (aeads.length > MAX_AEADS_OFFERED || aeads.some((a) => a === AEAD_CHACHA20_POLY1305 || !(a in AEAD_NAMES))) {
    throw new Error(`aeads: offer at most ${MAX_AEADS_OFFERED} of ${Object.values(AEAD_NAMES).slice(1).join(", ")}`);
  }
}

/** The SessionChallenge in `data`, checked (4.1); ProtocolError with the close code to use. */
export function parseChallenge(data: Uint8Array, opts: HandshakeOptions): SessionChallenge {
  let ch;
  try {
    ch = fromBinary(SessionChallengeSchema, data);
  } catch (exc) {
    throw new ProtocolError(
      CloseCode.PROTOCOL_ERROR,
      `not a SessionChallenge: ${exc instanceof Error ? exc.message : String(exc)}`,
    );
  }
  if (ch.nonce.byteLength !== NONCE_BYTES) {
    throw new ProtocolError(
      CloseCode.PROTOCOL_ERROR,
      `challenge nonce must be ${NONCE_BYTES} bytes, got ${ch.nonce.byteLength}`,
    );
  }
  if (!isAddress(ch.hubKey)) {
    throw new ProtocolError(CloseCode.PROTOCOL_ERROR, "challenge hub_key must be 64 lowercase hex characters");
  }
  const pinned = opts.expectedHubKey;
  if (pinned !== undefined && ch.hubKey !== pinned) {
    throw new ProtocolError(
      CloseCode.HUB_KEY_MISMATCH,
      `unexpected hub key ${ch.hubKey.slice(0, 16)}…: this worker pins ${pinned.slice(0, 16)}… (--hub-key)`,
    );
  }
  if (ch.kxPublic.byteLength !== 0 && ch.kxPublic.byteLength !== 32) {
    throw new ProtocolError(
      CloseCode.POLICY_VIOLATION,
      `challenge kx_public must be 32 bytes, got ${ch.kxPublic.byteLength}`,
    );
  }
  if (opts.requireEncryption && ch.kxPublic.byteLength === 0) {
    throw new ProtocolError(
      CloseCode.E2E_MISMATCH,
      "the hub offers no end-to-end encryption (no key exchange in its challenge) and this worker requires it " +
        "(--e2e require)",
    );
  }
  return ch;
}

/** The HelloBody's bytes answering `ch` for the wallet `address` and key exchange `kxPublic`. */
export function helloBody(
  info: HelloFacts,
  address: string,
  ch: SessionChallenge,
  kxPublic: Uint8Array,
  opts: HandshakeOptions,
): Uint8Array {
  return toBinary(
    HelloBodySchema,
    create(HelloBodySchema, {
      nonce: ch.nonce,
      hubKey: ch.hubKey,
      wallet: address,
      slices: [...info.slices]
        .sort((a, b) => a[0] - b[0])
        .map(([layer, experts]) => create(ExpertSliceSchema, { layer, experts })),
      weightsDigest: info.weightsDigest,
      device: info.device,
      modelType: info.modelType,
      workerVersion: info.workerVersion,
      kxPublic,
      hubKxPublic: ch.kxPublic,
      requireEncryption: opts.requireEncryption,
      aeads: opts.aeads,
      projections: info.projections,
      ...(info.extra ?? {}),
    }),
  );
}

/** The bytes the hello's signature covers. */
export function helloSignedMessage(body: Uint8Array): Uint8Array {
  return concat(HELLO_SIGNATURE_DOMAIN, body);
}

/** The SessionHello's bytes: the body and its signature. */
export function helloMessage(body: Uint8Array, signature: Uint8Array): Uint8Array {
  return toBinary(SessionHelloSchema, create(SessionHelloSchema, { body, signature }));
}

/** The SessionAccept in `data`, checked as far as it can be before its signature (4.3). */
export function parseAccept(data: Uint8Array): { msg: SessionAccept; aead: number } {
  let msg;
  try {
    msg = fromBinary(SessionAcceptSchema, data);
  } catch (exc) {
    throw new ProtocolError(
      CloseCode.PROTOCOL_ERROR,
      `not a SessionAccept: ${exc instanceof Error ? exc.message : String(exc)}`,
    );
  }
  // "1 to 128 characters": counted as Unicode code points, as Python's len() counts them.
  const chars = [...msg.sessionId].length;
  if (chars === 0 || chars > MAX_SESSION_ID_CHARS) {
    throw new ProtocolError(
      CloseCode.PROTOCOL_ERROR,
      `accept: session_id must be 1 to ${MAX_SESSION_ID_CHARS} characters`,
    );
  }
  if (msg.signature.byteLength === 0) {
    throw new ProtocolError(
      CloseCode.POLICY_VIOLATION,
      "accept: not signed by the hub (a hub too old for this worker, or a relay that stripped the signature)",
    );
  }
  const aead = Number(msg.aead);
  if (!(aead in AEAD_NAMES)) {
    throw new ProtocolError(
      CloseCode.POLICY_VIOLATION,
      `accept: unknown tunnel AEAD ${aead}, which this worker did not offer`,
    );
  }
  return { msg, aead };
}

/** ProtocolError for a signed accept that breaks this worker's terms (after its signature checked). */
export function badAccept(
  msg: SessionAccept,
  aead: number,
  opts: HandshakeOptions,
  hubKx: Uint8Array,
): ProtocolError | undefined {
  if (aead !== AEAD_CHACHA20_POLY1305 && (!opts.aeads.includes(aead) || !msg.encrypted)) {
    return new ProtocolError(
      CloseCode.POLICY_VIOLATION,
      msg.encrypted
        ? `accept: tunnel AEAD ${AEAD_NAMES[aead]}, which this worker did not offer`
        : "accept: an AEAD named for a tunnel that is not encrypted",
    );
  }
  if (msg.encrypted && hubKx.byteLength === 0) {
    return new ProtocolError(CloseCode.POLICY_VIOLATION, "accept: encrypted, but the challenge had no key exchange");
  }
  if (!msg.encrypted && opts.requireEncryption) {
    return new ProtocolError(
      CloseCode.E2E_MISMATCH,
      "accept: the hub did not encrypt this session and this worker requires it (--e2e require)",
    );
  }
  return undefined;
}

export function badSignature(hubKey: string): ProtocolError {
  const why = `accept: bad signature (not hub ${hubKey.slice(0, 16)}… over this connection's handshake)`;
  return new ProtocolError(CloseCode.POLICY_VIOLATION, why);
}
