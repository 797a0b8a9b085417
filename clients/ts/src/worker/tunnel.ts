// Tunnel control (PROTOCOL.md 5): the worker's side of the state machine, without I/O.

import { CloseCode, LocalProtocolError, ProtocolError } from "./bytes_core.js";

export type TunnelState = "IDLE" | "OPEN" | "EOF" | "CLOSING";
export const CONTROL_WORDS = ["open", "eof", "close", "closed"] as const;
/** At most this many bytes of HTTP/2 in one data message. */
export const MAX_DATA_BYTES = 1 << 20;

// (state, "recv X" | "send X") -> next state: the worker's table (5.3).
const WORKER: Record<string, TunnelState> = {
  "IDLE recv open": "OPEN",
  "OPEN recv data": "OPEN",
  "OPEN send data": "OPEN",
  "OPEN send eof": "EOF",
  "OPEN recv close": "CLOSING",
  "EOF recv data": "EOF", // sent before the hub saw "eof": dropped
  "EOF recv close": "CLOSING",
  "CLOSING send data": "CLOSING", // in flight when "close" came: the hub discards it
  "CLOSING send eof": "CLOSING",
  "CLOSING send closed": "IDLE",
};

/** What a received message means for the worker. */
export type TunnelEvent =
  | { kind: "open" }
  | { kind: "data"; data: Uint8Array; drop: boolean } // drop: after "eof", bytes for a connection already ended
  | { kind: "close" };

export class WorkerTunnel {
  state: TunnelState = "IDLE";
  /** Connections opened so far. */
  connections = 0;

  private send(what: string): void {
    const next = WORKER[`${this.state} send ${what}`];
    if (next === undefined) throw new LocalProtocolError(`worker tunnel: can't send ${what} in state ${this.state}`);
    this.state = next;
  }

  /** A message from the hub (text: a control word; bytes: data). ProtocolError 1002 on a violation. */
  receive(msg: string | Uint8Array): TunnelEvent {
    let what: string;
    if (typeof msg === "string") {
      if (!(CONTROL_WORDS as readonly string[]).includes(msg)) {
        throw new ProtocolError(CloseCode.PROTOCOL_ERROR, `unknown control message ${JSON.stringify(msg.slice(0, 32))}: the tunnel's text messages are 'open', 'eof', 'close', 'closed'`);
      }
      what = msg;
    } else {
      what = "data";
    }
    const before = this.state;
    const next = WORKER[`${before} recv ${what}`];
    if (next === undefined) {
      const shown = typeof msg === "string" ? `'${msg}'` : `${msg.byteLength} bytes of data`;
      throw new ProtocolError(CloseCode.PROTOCOL_ERROR, `the hub sent ${shown} while the tunnel is ${before}`);
    }
    this.state = next;
    if (what === "open") {
      this.connections += 1;
      return { kind: "open" };
    }
    if (what === "close") return { kind: "close" };
    return { kind: "data", data: msg as Uint8Array, drop: before === "EOF" };
  }

  /** Bytes the local server wrote (at most 1 MiB per message). */
  sendData(n: number): void {
    if (n > MAX_DATA_BYTES) throw new LocalProtocolError(`a tunnel message carries at most ${MAX_DATA_BYTES} bytes, not ${n}`);
    this.send("data");
  }

  /** The local server ended the connection. */
  eof(): string {
    this.send("eof");
    return "eof";
  }

  /** The local connection is dropped. */
  closed(): string {
    this.send("closed");
    return "closed";
  }

  /** Whether data may be sent now (OPEN or CLOSING). */
  canSendData(): boolean {
    return this.state === "OPEN" || this.state === "CLOSING";
  }
}
