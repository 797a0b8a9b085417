// The end-to-end channel (PROTOCOL.md 4.5) without its cryptography: the AEADs' names, the
// sealed messages' kinds, nonces and key-derivation label, what an opened message means, and
// the sealed heartbeat's bookkeeping. No Node API: channel.ts seals with node:crypto, the
// browser worker (clients/web) with WebCrypto.

import { CloseCode, LocalProtocolError, ProtocolError } from "./bytes_core.js";

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
export const TAG_BYTES = 16;

/** HKDF's info for the tunnel keys of `aead`. */
export function tunnelKeysInfo(aead: number): string {
  return aead === AEAD_CHACHA20_POLY1305 ? TUNNEL_KEYS_INFO : `${TUNNEL_KEYS_INFO} ${AEAD_NAMES[aead]}`;
}

/** The 12-byte nonce of message number `counter`: 4 zero bytes, then the counter, big-endian. */
export function sealNonce(counter: bigint): Uint8Array {
  const b = new Uint8Array(12);
  new DataView(b.buffer).setBigUint64(4, counter, false);
  return b;
}

/** The 8-byte big-endian sequence number a sealed heartbeat or ack carries. */
export function heartbeatPayload(seq: bigint): Uint8Array {
  const b = new Uint8Array(8);
  new DataView(b.buffer).setBigUint64(0, seq, false);
  return b;
}

/** What a sealed message opened to. */
export type Opened =
  | { kind: "data"; data: Uint8Array }
  | { kind: "control"; word: string }
  | { kind: "heartbeat"; seq: bigint }
  | { kind: "ack"; seq: bigint };

/** What the opened plaintext `plain` (its kind byte, then the payload) means; `fail` makes the
 * error (1008) for one that does not make sense. */
export function interpretOpened(plain: Uint8Array, fail: (why: string) => Error): Opened {
  const kind = plain[0];
  const payload = plain.subarray(1);
  switch (kind) {
    case SEALED_DATA:
      return { kind: "data", data: payload };
    case SEALED_CONTROL: {
      let word: string;
      try {
        word = new TextDecoder("utf-8", { fatal: true }).decode(payload);
      } catch {
        throw fail("a sealed control message is not UTF-8");
      }
      return { kind: "control", word };
    }
    case SEALED_HEARTBEAT:
    case SEALED_HEARTBEAT_ACK: {
      const name = kind === SEALED_HEARTBEAT ? "heartbeat" : "heartbeat ack";
      if (payload.byteLength !== 8) {
        throw fail(`a sealed ${name} carries ${payload.byteLength} bytes, not its 8-byte sequence number`);
      }
      const seq = new DataView(payload.buffer, payload.byteOffset, 8).getBigUint64(0, false);
      return kind === SEALED_HEARTBEAT ? { kind: "heartbeat", seq } : { kind: "ack", seq };
    }
    default:
      throw fail(`a sealed message of unknown kind ${kind} (0: data, 1: control, 2: heartbeat, 3: heartbeat ack)`);
  }
}

/** Why a received message cannot be opened before trying (a text message, or too short), or undefined. */
export function unopenable(message: Uint8Array | string, peer: string): string | undefined {
  if (typeof message === "string") {
    return `a text message on an encrypted tunnel: the ${peer} or a relay sent clear text`;
  }
  if (message.byteLength < SEAL_OVERHEAD) {
    return `a sealed message of ${message.byteLength} bytes is shorter than its ${SEAL_OVERHEAD} bytes of overhead`;
  }
  return undefined;
}

/** The error for message `n` that failed its tag. */
export function tagFailure(n: bigint, peer: string): string {
  const how = "altered, replayed, reordered or dropped on the way";
  return `message ${n} from the ${peer} failed its authentication tag: ${how}`;
}

/** The sending side of the sealed heartbeat: numbers heartbeats 0, 1, 2, ... and checks each ack. */
export class HeartbeatMonitor {
  private next = 0n;
  waiting: bigint | undefined;

  /** The next heartbeat's number; LocalProtocolError while the last is unanswered. */
  beat(): bigint {
    if (this.waiting !== undefined) {
      throw new LocalProtocolError(`heartbeat ${this.waiting} is still waiting for its answer`);
    }
    this.waiting = this.next;
    this.next += 1n;
    return this.waiting;
  }

  /** An ack from the peer; ProtocolError 1008 unless it answers the heartbeat waiting. */
  receiveAck(seq: bigint): void {
    if (this.waiting === undefined) {
      throw new ProtocolError(
        CloseCode.POLICY_VIOLATION,
        `the hub acknowledged heartbeat ${seq}, but no heartbeat is waiting for an answer`,
      );
    }
    if (seq !== this.waiting) {
      throw new ProtocolError(
        CloseCode.POLICY_VIOLATION,
        `the hub acknowledged heartbeat ${seq}, but heartbeat ${this.waiting} is the one waiting`,
      );
    }
    this.waiting = undefined;
  }
}

