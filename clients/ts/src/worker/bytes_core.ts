// Small byte helpers shared by the worker's modules, and the close codes: no Node API (the
// browser worker, clients/web, imports them too); bytes.ts adds the Node-only helpers.

/** Lowercase hex of `b`. */
export function toHex(b: Uint8Array): string {
  let s = "";
  for (let i = 0; i < b.byteLength; i++) s += HEX[b[i]!];
  return s;
}

const HEX = Array.from({ length: 256 }, (_, i) => i.toString(16).padStart(2, "0"));

/** Bytes of an even-length hex string (throws on anything else). */
export function fromHex(hex: string): Uint8Array {
  if (hex.length % 2 !== 0 || !/^[0-9a-fA-F]*$/.test(hex)) throw new Error(`not hex: ${hex.slice(0, 40)}`);
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}

/** The concatenation of `parts`, as one fresh Uint8Array. */
export function concat(...parts: Uint8Array[]): Uint8Array {
  let n = 0;
  for (const p of parts) n += p.byteLength;
  const out = new Uint8Array(n);
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.byteLength;
  }
  return out;
}

/** `text` as bytes, one per character (Node's "ascii" encoding: the low 8 bits of each). */
export function ascii(text: string): Uint8Array {
  const out = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i) & 0xff;
  return out;
}

export function utf8(text: string): Uint8Array {
  return new TextEncoder().encode(text);
}

export function u32be(n: number): Uint8Array {
  const b = new Uint8Array(4);
  new DataView(b.buffer).setUint32(0, n, false);
  return b;
}

export function u32le(n: number): Uint8Array {
  const b = new Uint8Array(4);
  new DataView(b.buffer).setUint32(0, n, true);
  return b;
}

export function u64le(n: number | bigint): Uint8Array {
  const b = new Uint8Array(8);
  new DataView(b.buffer).setBigUint64(0, BigInt(n), true);
  return b;
}

export function u64be(n: number | bigint): Uint8Array {
  const b = new Uint8Array(8);
  new DataView(b.buffer).setBigUint64(0, BigInt(n), false);
  return b;
}

export function equalBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.byteLength !== b.byteLength) return false;
  for (let i = 0; i < a.byteLength; i++) if (a[i] !== b[i]) return false;
  return true;
}

/** An error that ends a session with a WebSocket close code (PROTOCOL.md 7) and a reason. */
export class ProtocolError extends Error {
  constructor(
    readonly code: number,
    reason: string,
  ) {
    super(reason);
    this.name = "ProtocolError";
  }
}

/** A call of this side's own that the protocol does not allow in the current state (a bug). */
export class LocalProtocolError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "LocalProtocolError";
  }
}

/** Close codes (PROTOCOL.md 7): RFC 6455's, then the private ones, whose hundreds say what to do (closeClass). */
export const CloseCode = {
  NORMAL: 1000,
  GOING_AWAY: 1001,
  PROTOCOL_ERROR: 1002,
  POLICY_VIOLATION: 1008,
  MESSAGE_TOO_BIG: 1009,
  INTERNAL_ERROR: 1011,
  TRY_AGAIN_LATER: 1013,
  /** Permanent: any refusal the same hello gets again (the first private code). */
  REFUSED: 4008,
  /** A worker whose slice the hub planned plans again; any other dials again. */
  REPLAN: 4010,
  // 4100-4199, permanent: do not dial again unchanged.
  HELLO_INVALID: 4100,
  QUARANTINED: 4101,
  OUTSIDE_MODEL: 4102,
  E2E_MISMATCH: 4103,
  HUB_KEY_MISMATCH: 4104,
  // 4200-4299, retry: dial again after a backoff.
  HANDSHAKE_TIMEOUT: 4200,
  HELLO_STALE: 4201,
  WALLET_CAP: 4202,
  ADDRESS_CAP: 4203,
  HUB_FULL: 4204,
  RATE_LIMITED: 4205,
  NO_HUB: 4206,
  PAIRING_TIMEOUT: 4207,
  BUFFERS_FULL: 4208,
  MESSAGE_TIMEOUT: 4209,
  PAIRING_GONE: 4210,
} as const;

/** What a close code tells a worker to do (PROTOCOL.md 7). */
export type CloseClass = "permanent" | "retry" | "replan" | "closed";

/**
 * The class of a close code, by the code alone (never the reason, which is for people):
 * 4008 and 4100-4199 permanent; 4010 replan; 1000 and 1001 closed; every other code, known
 * or not, retry (a code this worker does not know never stops it outside 4100-4199).
 */
export function closeClass(code: number): CloseClass {
  if (code === CloseCode.REFUSED || (code >= 4100 && code <= 4199)) return "permanent";
  if (code === CloseCode.REPLAN) return "replan";
  if (code === CloseCode.NORMAL || code === CloseCode.GOING_AWAY) return "closed";
  return "retry";
}
