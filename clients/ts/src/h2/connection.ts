// A sans-IO HTTP/2 server connection (RFC 9113), after the design of python's h2: bytes go in
// through receiveData(), which returns events; the methods that answer (sendHeaders, sendData,
// resetStream, goAway, ping) queue frames, and dataToSend() hands over the bytes to write.
// No I/O, no timers, no Node-only API: the caller owns the transport (a socket, a tunnel, a
// WebSocket in a web page).
//
// It does: the client preface, the SETTINGS exchange and its ACK, PING ACK, HPACK with
// CONTINUATION, padding, PRIORITY (parsed and ignored), flow control both ways (outgoing DATA
// beyond a window is buffered and sent on WINDOW_UPDATE; WINDOW_UPDATE is sent for the data
// the application acknowledges), frame and header list size limits, SETTINGS_MAX_CONCURRENT_STREAMS,
// RST_STREAM, and GOAWAY with the RFC's error code for each connection error.

import { HeaderListTooLargeError, HpackDecoder, HpackEncoder, HpackError, type Header } from "./hpack.js";

export type { Header } from "./hpack.js";

export const FrameType = {
  DATA: 0x0,
  HEADERS: 0x1,
  PRIORITY: 0x2,
  RST_STREAM: 0x3,
  SETTINGS: 0x4,
  PUSH_PROMISE: 0x5,
  PING: 0x6,
  GOAWAY: 0x7,
  WINDOW_UPDATE: 0x8,
  CONTINUATION: 0x9,
} as const;

export const Flag = { END_STREAM: 0x1, ACK: 0x1, END_HEADERS: 0x4, PADDED: 0x8, PRIORITY: 0x20 } as const;

export const ErrorCode = {
  NO_ERROR: 0x0,
  PROTOCOL_ERROR: 0x1,
  INTERNAL_ERROR: 0x2,
  FLOW_CONTROL_ERROR: 0x3,
  SETTINGS_TIMEOUT: 0x4,
  STREAM_CLOSED: 0x5,
  FRAME_SIZE_ERROR: 0x6,
  REFUSED_STREAM: 0x7,
  CANCEL: 0x8,
  COMPRESSION_ERROR: 0x9,
  CONNECT_ERROR: 0xa,
  ENHANCE_YOUR_CALM: 0xb,
  INADEQUATE_SECURITY: 0xc,
  HTTP_1_1_REQUIRED: 0xd,
} as const;

export const Setting = {
  HEADER_TABLE_SIZE: 0x1,
  ENABLE_PUSH: 0x2,
  MAX_CONCURRENT_STREAMS: 0x3,
  INITIAL_WINDOW_SIZE: 0x4,
  MAX_FRAME_SIZE: 0x5,
  MAX_HEADER_LIST_SIZE: 0x6,
} as const;

export const CLIENT_PREFACE = new TextEncoder().encode("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
export const FRAME_HEADER_BYTES = 9;
export const DEFAULT_WINDOW = 65535;
export const DEFAULT_MAX_FRAME = 16384;
export const MAX_WINDOW = 2 ** 31 - 1;
const MAX_FRAME_LIMIT = 2 ** 24 - 1;

/** A connection error (RFC 9113 5.4.1): GOAWAY with `code`. */
export class H2ConnectionError extends Error {
  override name = "H2ConnectionError";
  constructor(
    readonly code: number,
    message: string,
  ) {
    super(message);
  }
}

/** A stream error (5.4.2): RST_STREAM with `code`. */
export class H2StreamError extends Error {
  override name = "H2StreamError";
  constructor(
    readonly streamId: number,
    readonly code: number,
    message: string,
  ) {
    super(message);
  }
}

/** The application asked to send on a stream that cannot carry it (closed, reset, unknown). */
export class H2StreamClosedError extends Error {
  override name = "H2StreamClosedError";
  constructor(readonly streamId: number) {
    super(`stream ${streamId} is closed`);
  }
}

export type H2Event =
  /** A request's header block (the stream is new). */
  | { type: "request"; streamId: number; headers: Header[]; endStream: boolean }
  /** Trailers: a header block after the request's data (always with END_STREAM). */
  | { type: "trailers"; streamId: number; headers: Header[] }
  /** Request body bytes. Their window goes back to the peer once the application calls
   * acknowledgeReceivedData(streamId, flowControlledLength); padding is returned at once. */
  | { type: "data"; streamId: number; data: Uint8Array; flowControlledLength: number; endStream: boolean }
  /** The client ended its side of the stream (END_STREAM, after "request", "data" or "trailers"). */
  | { type: "streamEnded"; streamId: number }
  /** The stream was reset: by the peer (remote) or by this side for a stream error. */
  | { type: "streamReset"; streamId: number; errorCode: number; remote: boolean; message?: string }
  /** The peer's SETTINGS, applied and acknowledged. */
  | { type: "settings"; changed: Map<number, number> }
  | { type: "settingsAcked" }
  | { type: "ping"; data: Uint8Array }
  | { type: "pingAck"; data: Uint8Array }
  | { type: "goaway"; errorCode: number; lastStreamId: number; debug: Uint8Array }
  | { type: "windowUpdate"; streamId: number; delta: number }
  /** A connection error: GOAWAY with `errorCode` is queued; the connection takes nothing more. */
  | { type: "connectionError"; errorCode: number; message: string };

export interface H2ServerOptions {
  /** SETTINGS_MAX_CONCURRENT_STREAMS announced and enforced (default 100). */
  maxConcurrentStreams?: number;
  /** SETTINGS_INITIAL_WINDOW_SIZE: each stream's receive window (default 1 MiB). */
  initialWindowSize?: number;
  /** The connection's receive window (default 16 MiB; raised from 65535 by a WINDOW_UPDATE). */
  connectionWindowSize?: number;
  /** SETTINGS_MAX_FRAME_SIZE: the largest frame payload taken (default 16384). */
  maxFrameSize?: number;
  /** SETTINGS_MAX_HEADER_LIST_SIZE announced and enforced (default 64 KiB). */
  maxHeaderListSize?: number;
  /** SETTINGS_HEADER_TABLE_SIZE for the peer's encoder (default 4096). */
  headerTableSize?: number;
}

type StreamState = "open" | "halfClosedRemote" | "halfClosedLocal";

type Outbound =
  | { kind: "headers"; headers: Header[]; end: boolean }
  | { kind: "data"; data: Uint8Array; at: number; end: boolean };

class Stream {
  state: StreamState = "open";
  /** Bytes this side may still send (the peer's window for the stream). */
  sendWindow: number;
  /** Bytes the peer may still send before a WINDOW_UPDATE. */
  recvWindow: number;
  /** Received bytes the application has acknowledged but no WINDOW_UPDATE has returned yet. */
  unacked = 0;
  readonly queue: Outbound[] = [];
  /** DATA bytes queued and not sent. */
  queuedBytes = 0;
  /** The local side's END_STREAM is queued (no more may be queued). */
  endQueued = false;

  constructor(
    readonly id: number,
    sendWindow: number,
    recvWindow: number,
  ) {
    this.sendWindow = sendWindow;
    this.recvWindow = recvWindow;
  }
}

/** How a stream closed, for frames that arrive after (5.1 "closed"). */
type ClosedHow = "reset" | "ended";
const CLOSED_MEMORY = 1024;

/** Pseudo-header fields of a request (8.3.1). */
const REQUEST_PSEUDO = new Set([":method", ":scheme", ":authority", ":path"]);
/** Connection-specific fields, malformed in HTTP/2 (8.2.2). */
const CONNECTION_SPECIFIC = new Set(["connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"]);

function u32(b: Uint8Array, at: number): number {
  return ((b[at]! << 24) | (b[at + 1]! << 16) | (b[at + 2]! << 8) | b[at + 3]!) >>> 0;
}

/** One frame's bytes: the 9-byte header, then `payload` (or `payloadLength` bytes written later). */
export function frameHeader(length: number, type: number, flags: number, streamId: number): Uint8Array {
  const f = new Uint8Array(FRAME_HEADER_BYTES);
  f[0] = (length >>> 16) & 0xff;
  f[1] = (length >>> 8) & 0xff;
  f[2] = length & 0xff;
  f[3] = type;
  f[4] = flags;
  f[5] = (streamId >>> 24) & 0x7f;
  f[6] = (streamId >>> 16) & 0xff;
  f[7] = (streamId >>> 8) & 0xff;
  f[8] = streamId & 0xff;
  return f;
}

export function encodeFrame(type: number, flags: number, streamId: number, payload: Uint8Array): Uint8Array {
  const f = new Uint8Array(FRAME_HEADER_BYTES + payload.length);
  f.set(frameHeader(payload.length, type, flags, streamId));
  f.set(payload, FRAME_HEADER_BYTES);
  return f;
}

function u32Bytes(...values: number[]): Uint8Array {
  const b = new Uint8Array(4 * values.length);
  const v = new DataView(b.buffer);
  values.forEach((x, i) => v.setUint32(4 * i, x >>> 0));
  return b;
}

export function concatBytes(parts: readonly Uint8Array[]): Uint8Array {
  if (parts.length === 1) return parts[0]!;
  let n = 0;
  for (const p of parts) n += p.length;
  const out = new Uint8Array(n);
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

export class H2ServerConnection {
  private readonly decoder: HpackDecoder;
  private readonly encoder = new HpackEncoder();
  private readonly out: Uint8Array[] = [];
  private outBytes = 0;
  /** Unparsed received bytes. */
  private inbuf: Uint8Array[] = [];
  private inBytes = 0;
  private prefaceSeen = false;
  private settingsSeen = false;
  private closed = false;
  private goawaySent = false;

  private readonly streams = new Map<number, Stream>();
  private readonly closedStreams = new Map<number, ClosedHow>();
  /** The highest stream id the client has opened. */
  private highestStreamId = 0;
  /** A header block in progress: HEADERS without END_HEADERS, then CONTINUATION. */
  private headerBlock:
    | { streamId: number; parts: Uint8Array[]; bytes: number; endStream: boolean; selfDependent: boolean }
    | undefined;

  // Our settings: announced, and the value in force (applied once the peer ACKs).
  private readonly local: Required<H2ServerOptions>;
  private localInitialWindow = DEFAULT_WINDOW;
  private settingsAwaitingAck = 0;
  private readonly connectionWindowTarget: number;
  private connRecvWindow = DEFAULT_WINDOW;
  private connUnacked = 0;

  // The peer's settings.
  private peerInitialWindow = DEFAULT_WINDOW;
  private peerMaxFrame = DEFAULT_MAX_FRAME;
  private connSendWindow = DEFAULT_WINDOW;
  /** Streams with queued frames, in the order they will be served (round robin). */
  private sendOrder: number[] = [];
  peerGoaway: { errorCode: number; lastStreamId: number } | undefined;

  constructor(opts: H2ServerOptions = {}) {
    this.local = {
      maxConcurrentStreams: opts.maxConcurrentStreams ?? 100,
      initialWindowSize: opts.initialWindowSize ?? 1 << 20,
      connectionWindowSize: opts.connectionWindowSize ?? 16 << 20,
      maxFrameSize: opts.maxFrameSize ?? DEFAULT_MAX_FRAME,
      maxHeaderListSize: opts.maxHeaderListSize ?? 65536,
      headerTableSize: opts.headerTableSize ?? 4096,
    };
    if (this.local.initialWindowSize > MAX_WINDOW || this.local.connectionWindowSize > MAX_WINDOW) {
      throw new RangeError("a window over 2^31-1");
    }
    if (this.local.maxFrameSize < DEFAULT_MAX_FRAME || this.local.maxFrameSize > MAX_FRAME_LIMIT) {
      throw new RangeError("maxFrameSize outside [16384, 2^24-1]");
    }
    this.decoder = new HpackDecoder({
      maxTableSize: this.local.headerTableSize,
      maxHeaderListSize: this.local.maxHeaderListSize,
    });
    this.connectionWindowTarget = this.local.connectionWindowSize;
    // The server's preface: SETTINGS (3.4), and the connection window raised at once.
    const s = this.local;
    this.emitSettings([
      [Setting.MAX_CONCURRENT_STREAMS, s.maxConcurrentStreams],
      [Setting.INITIAL_WINDOW_SIZE, s.initialWindowSize],
      [Setting.MAX_FRAME_SIZE, s.maxFrameSize],
      [Setting.MAX_HEADER_LIST_SIZE, s.maxHeaderListSize],
      [Setting.HEADER_TABLE_SIZE, s.headerTableSize],
      [Setting.ENABLE_PUSH, 0],
    ]);
    if (this.connectionWindowTarget > DEFAULT_WINDOW) {
      this.write(encodeFrame(FrameType.WINDOW_UPDATE, 0, 0, u32Bytes(this.connectionWindowTarget - DEFAULT_WINDOW)));
      this.connRecvWindow = this.connectionWindowTarget;
    }
  }

  // -- output -----------------------------------------------------------------------------

  private write(b: Uint8Array): void {
    this.out.push(b);
    this.outBytes += b.length;
  }

  /** The bytes to write to the transport now (empty when none). */
  dataToSend(): Uint8Array {
    if (this.out.length === 0) return new Uint8Array(0);
    const b = concatBytes(this.out);
    this.out.length = 0;
    this.outBytes = 0;
    return b;
  }

  /** Bytes waiting in dataToSend(). */
  get pendingOutputBytes(): number {
    return this.outBytes;
  }

  /** True once this side sent GOAWAY for an error: it reads nothing more (write what
   * dataToSend() still has, then close the transport). */
  get isClosed(): boolean {
    return this.closed;
  }

  private emitSettings(pairs: [number, number][]): void {
    const p = new Uint8Array(6 * pairs.length);
    const v = new DataView(p.buffer);
    pairs.forEach(([id, value], i) => {
      v.setUint16(6 * i, id);
      v.setUint32(6 * i + 2, value);
    });
    this.write(encodeFrame(FrameType.SETTINGS, 0, 0, p));
    this.settingsAwaitingAck += 1;
  }

  // -- input ------------------------------------------------------------------------------

  /** Take bytes read from the transport; returns what they mean. A protocol error queues a
   * GOAWAY (see dataToSend) and ends with a "connectionError" event. */
  receiveData(bytes: Uint8Array): H2Event[] {
    const events: H2Event[] = [];
    if (this.closed || bytes.length === 0) return events;
    this.inbuf.push(bytes);
    this.inBytes += bytes.length;
    try {
      if (!this.prefaceSeen) {
        const n = Math.min(this.inBytes, CLIENT_PREFACE.length);
        const head = this.peek(n);
        for (let i = 0; i < n; i++) {
          if (head[i] !== CLIENT_PREFACE[i]) {
            throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "invalid client preface");
          }
        }
        if (n < CLIENT_PREFACE.length) return events;
        this.take(CLIENT_PREFACE.length);
        this.prefaceSeen = true;
      }
      while (!this.closed && this.inBytes >= FRAME_HEADER_BYTES) {
        const h = this.peek(FRAME_HEADER_BYTES);
        const length = (h[0]! << 16) | (h[1]! << 8) | h[2]!;
        const type = h[3]!;
        const flags = h[4]!;
        const streamId = u32(h, 5) & 0x7fffffff;
        if (length > this.local.maxFrameSize) {
          throw new H2ConnectionError(
            ErrorCode.FRAME_SIZE_ERROR,
            `frame of ${length} bytes, over SETTINGS_MAX_FRAME_SIZE ${this.local.maxFrameSize}`,
          );
        }
        if (this.inBytes < FRAME_HEADER_BYTES + length) break;
        this.take(FRAME_HEADER_BYTES);
        const payload = this.take(length);
        try {
          this.frame(type, flags, streamId, payload, events);
        } catch (exc) {
          if (!(exc instanceof H2StreamError)) throw exc;
          this.streamError(exc, events);
        }
      }
    } catch (exc) {
      if (exc instanceof H2ConnectionError) this.connectionError(exc, events);
      else throw exc;
    }
    return events;
  }

  /** The first `n` buffered bytes, without consuming them. */
  private peek(n: number): Uint8Array {
    const first = this.inbuf[0]!;
    if (first.length >= n) return first.subarray(0, n);
    const joined = concatBytes(this.inbuf);
    this.inbuf = [joined];
    return joined.subarray(0, n);
  }

  private take(n: number): Uint8Array {
    if (n === 0) return new Uint8Array(0);
    let out: Uint8Array;
    const first = this.inbuf[0]!;
    if (first.length >= n) {
      out = first.subarray(0, n);
      if (first.length === n) this.inbuf.shift();
      else this.inbuf[0] = first.subarray(n);
    } else {
      out = new Uint8Array(n);
      let at = 0;
      while (at < n) {
        const c = this.inbuf[0]!;
        const k = Math.min(c.length, n - at);
        out.set(c.subarray(0, k), at);
        at += k;
        if (k === c.length) this.inbuf.shift();
        else this.inbuf[0] = c.subarray(k);
      }
    }
    this.inBytes -= n;
    return out;
  }

  private connectionError(exc: H2ConnectionError, events: H2Event[]): void {
    this.goAway(exc.code, exc.message);
    this.closed = true;
    events.push({ type: "connectionError", errorCode: exc.code, message: exc.message });
  }

  private streamError(exc: H2StreamError, events: H2Event[]): void {
    const s = this.streams.get(exc.streamId);
    this.write(encodeFrame(FrameType.RST_STREAM, 0, exc.streamId, u32Bytes(exc.code)));
    if (s) this.dropStream(s, "reset");
    else this.rememberClosed(exc.streamId, "reset");
    const { streamId, code: errorCode, message } = exc;
    events.push({ type: "streamReset", streamId, errorCode, remote: false, message });
  }

  private frame(type: number, flags: number, id: number, p: Uint8Array, events: H2Event[]): void {
    if (!this.settingsSeen) {
      // The client preface's first frame is SETTINGS (3.4).
      if (type !== FrameType.SETTINGS || flags & Flag.ACK) {
        throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "the client preface does not start with SETTINGS");
      }
      this.settingsSeen = true;
    }
    if (this.headerBlock && type !== FrameType.CONTINUATION) {
      throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "a header block interrupted by another frame");
    }
    switch (type) {
      case FrameType.DATA:
        return this.onData(flags, id, p, events);
      case FrameType.HEADERS:
        return this.onHeaders(flags, id, p, events);
      case FrameType.PRIORITY:
        return this.onPriority(id, p);
      case FrameType.RST_STREAM:
        return this.onRstStream(id, p, events);
      case FrameType.SETTINGS:
        return this.onSettings(flags, id, p, events);
      case FrameType.PUSH_PROMISE:
        throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE from a client");
      case FrameType.PING:
        return this.onPing(flags, id, p, events);
      case FrameType.GOAWAY:
        return this.onGoaway(id, p, events);
      case FrameType.WINDOW_UPDATE:
        return this.onWindowUpdate(id, p, events);
      case FrameType.CONTINUATION:
        return this.onContinuation(flags, id, p, events);
      default:
        return; // unknown frame types are ignored (5.5)
    }
  }

  /** The payload without its padding (6.1, 6.2). */
  private unpad(flags: number, p: Uint8Array, what: string): Uint8Array {
    if (!(flags & Flag.PADDED)) return p;
    if (p.length < 1) throw new H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, `${what} too short for its pad length`);
    const pad = p[0]!;
    if (pad >= p.length) {
      throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, `${what} padding of ${pad} bytes fills the frame`);
    }
    return p.subarray(1, p.length - pad);
  }

  private onData(flags: number, id: number, p: Uint8Array, events: H2Event[]): void {
    if (id === 0) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0");
    const length = p.length;
    // Connection flow control counts every DATA frame, whatever its stream's state (6.9).
    if (length > this.connRecvWindow) {
      throw new H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection's window");
    }
    this.connRecvWindow -= length;
    const data = this.unpad(flags, p, "DATA");
    const s = this.streams.get(id);
    if (!s || s.state === "halfClosedRemote") {
      this.creditConnection(length); // never delivered: its window comes back at once
      if (id > this.highestStreamId) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, `DATA on idle stream ${id}`);
      if (s || this.closedStreams.get(id) === "ended") {
        throw new H2StreamError(id, ErrorCode.STREAM_CLOSED, `DATA on stream ${id} after its END_STREAM`);
      }
      return; // a stream this side reset (or long gone): ignored
    }
    if (length > s.recvWindow) {
      throw new H2StreamError(id, ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the stream's window");
    }
    s.recvWindow -= length;
    const padding = length - data.length;
    const end = (flags & Flag.END_STREAM) !== 0;
    events.push({ type: "data", streamId: id, data, flowControlledLength: length - padding, endStream: end });
    if (padding) this.acknowledgeReceivedData(id, padding);
    if (end) this.remoteEnded(s, events);
  }

  private remoteEnded(s: Stream, events: H2Event[]): void {
    events.push({ type: "streamEnded", streamId: s.id });
    if (s.state === "halfClosedLocal") {
      this.dropStream(s, "ended");
    } else {
      s.state = "halfClosedRemote";
    }
  }

  private onHeaders(flags: number, id: number, p: Uint8Array, events: H2Event[]): void {
    if (id === 0) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0");
    let block = this.unpad(flags, p, "HEADERS");
    let selfDependent = false;
    if (flags & Flag.PRIORITY) {
      if (block.length < 5) {
        throw new H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority");
      }
      // A stream error, found once the block is decoded (HPACK must stay in step).
      selfDependent = (u32(block, 0) & 0x7fffffff) === id;
      block = block.subarray(5);
    }
    const endStream = (flags & Flag.END_STREAM) !== 0;
    this.headerBlock = { streamId: id, parts: [block], bytes: block.length, endStream, selfDependent };
    if (flags & Flag.END_HEADERS) this.endHeaderBlock(events);
  }

  private onContinuation(flags: number, id: number, p: Uint8Array, events: H2Event[]): void {
    const hb = this.headerBlock;
    if (!hb || hb.streamId !== id) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "CONTINUATION out of place");
    hb.parts.push(p);
    hb.bytes += p.length;
    // A header block far over the header list limit is a flood, not a request (10.5).
    if (hb.bytes > Math.max(4 * this.local.maxHeaderListSize, 1 << 16)) {
      throw new H2ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, `header block of over ${hb.bytes} bytes`);
    }
    if (flags & Flag.END_HEADERS) this.endHeaderBlock(events);
  }

  private endHeaderBlock(events: H2Event[]): void {
    const hb = this.headerBlock!;
    const selfDependent = hb.selfDependent;
    this.headerBlock = undefined;
    const id = hb.streamId;
    let headers: Header[] | undefined;
    let tooLarge: HeaderListTooLargeError | undefined;
    try {
      headers = this.decoder.decode(concatBytes(hb.parts));
    } catch (exc) {
      if (exc instanceof HpackError) throw new H2ConnectionError(ErrorCode.COMPRESSION_ERROR, exc.message);
      if (!(exc instanceof HeaderListTooLargeError)) throw exc;
      tooLarge = exc;
    }
    const s = this.streams.get(id);
    if (s) {
      // Trailers (8.1): they end the request.
      if (selfDependent) throw new H2StreamError(id, ErrorCode.PROTOCOL_ERROR, "stream depends on itself");
      if (s.state === "halfClosedRemote") {
        throw new H2StreamError(id, ErrorCode.STREAM_CLOSED, `HEADERS on stream ${id} after its END_STREAM`);
      }
      if (tooLarge) throw new H2StreamError(id, ErrorCode.PROTOCOL_ERROR, tooLarge.message);
      if (!hb.endStream) throw new H2StreamError(id, ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM");
      const why = checkFields(headers!, true);
      if (why) throw new H2StreamError(id, ErrorCode.PROTOCOL_ERROR, `malformed trailers: ${why}`);
      events.push({ type: "trailers", streamId: id, headers: headers! });
      this.remoteEnded(s, events);
      return;
    }
    if (id <= this.highestStreamId) {
      if (this.closedStreams.get(id) === "reset") return; // sent before our RST_STREAM reached the peer
      throw new H2ConnectionError(ErrorCode.STREAM_CLOSED, `HEADERS on closed stream ${id}`);
    }
    if (id % 2 === 0) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, `client stream id ${id} is even`);
    this.highestStreamId = id;
    if (this.goawaySent) return; // no new streams after GOAWAY: ignored (6.8)
    if (selfDependent) throw new H2StreamError(id, ErrorCode.PROTOCOL_ERROR, "stream depends on itself");
    if (this.streams.size >= this.local.maxConcurrentStreams) {
      const max = this.local.maxConcurrentStreams;
      throw new H2StreamError(id, ErrorCode.REFUSED_STREAM, `over ${max} concurrent streams`);
    }
    if (tooLarge) {
      // 431 (RFC 6585), as 10.5.1 suggests; the stream is answered, not reset.
      const st = new Stream(id, this.peerInitialWindow, this.localInitialWindow);
      if (hb.endStream) st.state = "halfClosedRemote";
      this.streams.set(id, st);
      this.sendHeaders(id, [[":status", "431"]], true);
      events.push({ type: "streamReset", streamId: id, errorCode: ErrorCode.REFUSED_STREAM, remote: false,
        message: tooLarge.message });
      return;
    }
    const why = checkFields(headers!, false);
    if (why) throw new H2StreamError(id, ErrorCode.PROTOCOL_ERROR, `malformed request: ${why}`);
    const s2 = new Stream(id, this.peerInitialWindow, this.localInitialWindow);
    this.streams.set(id, s2);
    events.push({ type: "request", streamId: id, headers: headers!, endStream: hb.endStream });
    if (hb.endStream) this.remoteEnded(s2, events);
  }

  private onPriority(id: number, p: Uint8Array): void {
    if (id === 0) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0");
    if (p.length !== 5) throw new H2StreamError(id, ErrorCode.FRAME_SIZE_ERROR, "PRIORITY of other than 5 bytes");
    if ((u32(p, 0) & 0x7fffffff) === id) {
      throw new H2StreamError(id, ErrorCode.PROTOCOL_ERROR, "stream depends on itself");
    }
    // Prioritization is deprecated (RFC 9113 5.3.2): ignored.
  }

  private onRstStream(id: number, p: Uint8Array, events: H2Event[]): void {
    if (id === 0) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on stream 0");
    if (p.length !== 4) throw new H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM of other than 4 bytes");
    if (id > this.highestStreamId) {
      throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, `RST_STREAM on idle stream ${id}`);
    }
    const s = this.streams.get(id);
    if (!s) return; // already closed
    this.dropStream(s, "reset");
    events.push({ type: "streamReset", streamId: id, errorCode: u32(p, 0), remote: true });
  }

  private onSettings(flags: number, id: number, p: Uint8Array, events: H2Event[]): void {
    if (id !== 0) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream");
    if (flags & Flag.ACK) {
      if (p.length !== 0) throw new H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload");
      if (this.settingsAwaitingAck === 0) return;
      this.settingsAwaitingAck -= 1;
      // Our settings are in force from the ACK on (6.5.3): the peer saw them before its ACK.
      const delta = this.local.initialWindowSize - this.localInitialWindow;
      this.localInitialWindow = this.local.initialWindowSize;
      for (const s of this.streams.values()) s.recvWindow += delta;
      events.push({ type: "settingsAcked" });
      return;
    }
    if (p.length % 6 !== 0) {
      throw new H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes");
    }
    const changed = new Map<number, number>();
    for (let at = 0; at < p.length; at += 6) {
      const key = (p[at]! << 8) | p[at + 1]!;
      const value = u32(p, at + 2);
      switch (key) {
        case Setting.ENABLE_PUSH:
          if (value > 1) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, `SETTINGS_ENABLE_PUSH ${value}`);
          break;
        case Setting.INITIAL_WINDOW_SIZE: {
          if (value > MAX_WINDOW) {
            throw new H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, `SETTINGS_INITIAL_WINDOW_SIZE ${value}`);
          }
          const delta = value - this.peerInitialWindow;
          for (const s of this.streams.values()) {
            if (s.sendWindow + delta > MAX_WINDOW) {
              throw new H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "a stream's window over 2^31-1");
            }
            s.sendWindow += delta;
          }
          this.peerInitialWindow = value;
          break;
        }
        case Setting.MAX_FRAME_SIZE:
          if (value < DEFAULT_MAX_FRAME || value > MAX_FRAME_LIMIT) {
            throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, `SETTINGS_MAX_FRAME_SIZE ${value}`);
          }
          this.peerMaxFrame = value;
          break;
        case Setting.HEADER_TABLE_SIZE:
          this.encoder.setPeerTableSize(value);
          break;
        default:
          break; // MAX_CONCURRENT_STREAMS (we open none), MAX_HEADER_LIST_SIZE (advisory), unknown
      }
      changed.set(key, value);
    }
    this.write(encodeFrame(FrameType.SETTINGS, Flag.ACK, 0, new Uint8Array(0)));
    events.push({ type: "settings", changed });
    this.flush();
  }

  private onPing(flags: number, id: number, p: Uint8Array, events: H2Event[]): void {
    if (id !== 0) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PING on a stream");
    if (p.length !== 8) throw new H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "PING of other than 8 bytes");
    const data = p.slice();
    if (flags & Flag.ACK) {
      events.push({ type: "pingAck", data });
    } else {
      this.write(encodeFrame(FrameType.PING, Flag.ACK, 0, data));
      events.push({ type: "ping", data });
    }
  }

  private onGoaway(id: number, p: Uint8Array, events: H2Event[]): void {
    if (id !== 0) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream");
    if (p.length < 8) throw new H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes");
    const lastStreamId = u32(p, 0) & 0x7fffffff;
    const errorCode = u32(p, 4);
    this.peerGoaway = { errorCode, lastStreamId };
    events.push({ type: "goaway", errorCode, lastStreamId, debug: p.slice(8) });
  }

  private onWindowUpdate(id: number, p: Uint8Array, events: H2Event[]): void {
    if (p.length !== 4) throw new H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE of other than 4 bytes");
    const delta = u32(p, 0) & 0x7fffffff;
    if (id === 0) {
      if (delta === 0) throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection");
      if (this.connSendWindow + delta > MAX_WINDOW) {
        throw new H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "the connection's window over 2^31-1");
      }
      this.connSendWindow += delta;
    } else {
      if (id > this.highestStreamId) {
        throw new H2ConnectionError(ErrorCode.PROTOCOL_ERROR, `WINDOW_UPDATE on idle stream ${id}`);
      }
      const s = this.streams.get(id);
      if (!s) return; // closed: allowed, ignored (6.9)
      if (delta === 0) throw new H2StreamError(id, ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0");
      if (s.sendWindow + delta > MAX_WINDOW) {
        throw new H2StreamError(id, ErrorCode.FLOW_CONTROL_ERROR, "window over 2^31-1");
      }
      s.sendWindow += delta;
    }
    events.push({ type: "windowUpdate", streamId: id, delta });
    this.flush();
  }

  // -- flow control of received data --------------------------------------------------------

  /** The application has taken `n` flow-controlled bytes of `streamId`'s data: give the window
   * back (WINDOW_UPDATE once half a window has been consumed). */
  acknowledgeReceivedData(streamId: number, n: number): void {
    if (n <= 0 || this.closed) return;
    this.creditConnection(n);
    const s = this.streams.get(streamId);
    if (!s || s.state === "halfClosedRemote") return; // it sends no more: no stream update needed
    s.unacked += n;
    if (s.unacked >= this.localInitialWindow / 2) {
      s.recvWindow += s.unacked;
      this.write(encodeFrame(FrameType.WINDOW_UPDATE, 0, streamId, u32Bytes(s.unacked)));
      s.unacked = 0;
    }
  }

  private creditConnection(n: number): void {
    if (n <= 0 || this.closed) return;
    this.connUnacked += n;
    if (this.connUnacked >= this.connectionWindowTarget / 2) {
      this.connRecvWindow += this.connUnacked;
      this.write(encodeFrame(FrameType.WINDOW_UPDATE, 0, 0, u32Bytes(this.connUnacked)));
      this.connUnacked = 0;
    }
  }

  // -- sending ----------------------------------------------------------------------------

  private sendable(streamId: number): Stream {
    const s = this.streams.get(streamId);
    if (!s || s.state === "halfClosedLocal" || s.endQueued || this.closed) throw new H2StreamClosedError(streamId);
    return s;
  }

  /** True while `streamId` can take sendHeaders / sendData. */
  isStreamWritable(streamId: number): boolean {
    const s = this.streams.get(streamId);
    return s !== undefined && s.state !== "halfClosedLocal" && !s.endQueued && !this.closed;
  }

  /** Queue a header block (response headers, or trailers with `endStream`); it goes out after
   * the stream's queued DATA, split into HEADERS and CONTINUATION by the peer's frame size. */
  sendHeaders(streamId: number, headers: Header[], endStream = false): void {
    const s = this.sendable(streamId);
    s.queue.push({ kind: "headers", headers, end: endStream });
    if (endStream) s.endQueued = true;
    this.schedule(s);
  }

  /** Queue trailers: a header block that ends the stream. */
  sendTrailers(streamId: number, headers: Header[]): void {
    this.sendHeaders(streamId, headers, true);
  }

  /** Queue body bytes; what the flow-control windows do not allow waits for WINDOW_UPDATE. */
  sendData(streamId: number, data: Uint8Array, endStream = false): void {
    const s = this.sendable(streamId);
    s.queue.push({ kind: "data", data, at: 0, end: endStream });
    s.queuedBytes += data.length;
    if (endStream) s.endQueued = true;
    this.schedule(s);
  }

  /** End the local side with an empty DATA frame. */
  endStream(streamId: number): void {
    this.sendData(streamId, new Uint8Array(0), true);
  }

  /** DATA bytes of `streamId` queued and not yet sent (0 for an unknown stream). */
  queuedBytes(streamId: number): number {
    return this.streams.get(streamId)?.queuedBytes ?? 0;
  }

  /** How many bytes of DATA `streamId` may send now (the smaller of its and the connection's window). */
  localFlowControlWindow(streamId: number): number {
    const s = this.streams.get(streamId);
    if (!s) throw new H2StreamClosedError(streamId);
    return Math.max(0, Math.min(s.sendWindow, this.connSendWindow));
  }

  /** Reset a stream (RST_STREAM `code`); its queued frames are dropped. */
  resetStream(streamId: number, code: number = ErrorCode.CANCEL): void {
    const s = this.streams.get(streamId);
    if (!s || this.closed) return;
    this.write(encodeFrame(FrameType.RST_STREAM, 0, streamId, u32Bytes(code)));
    this.dropStream(s, "reset");
  }

  /** Send GOAWAY naming the last stream this side processed; an error code other than
   * NO_ERROR also closes the connection. */
  goAway(code: number = ErrorCode.NO_ERROR, debug = ""): void {
    if (this.closed) return;
    const text = new TextEncoder().encode(debug.slice(0, 256));
    const p = new Uint8Array(8 + text.length);
    p.set(u32Bytes(this.highestStreamId, code));
    p.set(text, 8);
    this.write(encodeFrame(FrameType.GOAWAY, 0, 0, p));
    this.goawaySent = true;
    if (code !== ErrorCode.NO_ERROR) this.closed = true;
  }

  /** Send a PING (8 bytes of opaque data). */
  ping(data: Uint8Array = new Uint8Array(8)): void {
    if (data.length !== 8) throw new RangeError("PING data is 8 bytes");
    if (!this.closed) this.write(encodeFrame(FrameType.PING, 0, 0, data.slice()));
  }

  /** Number of open streams. */
  get openStreams(): number {
    return this.streams.size;
  }

  private schedule(s: Stream): void {
    if (!this.sendOrder.includes(s.id)) this.sendOrder.push(s.id);
    this.flush();
  }

  /** Move queued frames into the output as far as the windows allow, a frame per stream in turn. */
  private flush(): void {
    let progress = true;
    while (progress && this.sendOrder.length) {
      progress = false;
      const order = this.sendOrder;
      this.sendOrder = [];
      for (const id of order) {
        const s = this.streams.get(id);
        if (!s || s.queue.length === 0) continue;
        if (this.sendOne(s)) progress = true;
        if (s.queue.length && this.streams.has(id)) this.sendOrder.push(id);
      }
    }
  }

  /** Send the head of `s`'s queue (one frame of it); false when blocked by flow control. */
  private sendOne(s: Stream): boolean {
    const item = s.queue[0]!;
    if (item.kind === "headers") {
      s.queue.shift();
      this.writeHeaderBlock(s.id, this.encoder.encode(item.headers), item.end);
      if (item.end) this.localEnded(s);
      return true;
    }
    const left = item.data.length - item.at;
    // A window can be negative (a smaller SETTINGS_INITIAL_WINDOW_SIZE, 6.9.2); an empty DATA is free.
    const n = Math.max(0, Math.min(left, s.sendWindow, this.connSendWindow, this.peerMaxFrame));
    if (n === 0 && left > 0) return false;
    const last = n === left;
    const flags = last && item.end ? Flag.END_STREAM : 0;
    this.write(frameHeader(n, FrameType.DATA, flags, s.id));
    if (n > 0) this.write(item.data.subarray(item.at, item.at + n));
    item.at += n;
    s.sendWindow -= n;
    this.connSendWindow -= n;
    s.queuedBytes -= n;
    if (last) {
      s.queue.shift();
      if (item.end) this.localEnded(s);
    }
    return true;
  }

  private writeHeaderBlock(id: number, block: Uint8Array, end: boolean): void {
    const max = this.peerMaxFrame;
    let at = 0;
    let type: number = FrameType.HEADERS;
    do {
      const n = Math.min(max, block.length - at);
      const lastPiece = at + n === block.length;
      let flags = lastPiece ? Flag.END_HEADERS : 0;
      if (type === FrameType.HEADERS && end) flags |= Flag.END_STREAM;
      this.write(encodeFrame(type, flags, id, block.subarray(at, at + n)));
      at += n;
      type = FrameType.CONTINUATION;
    } while (at < block.length);
  }

  private localEnded(s: Stream): void {
    if (s.state === "halfClosedRemote") {
      this.dropStream(s, "ended");
      return;
    }
    // A complete response before the whole request: ask the client to stop sending (8.1).
    s.state = "halfClosedLocal";
    this.write(encodeFrame(FrameType.RST_STREAM, 0, s.id, u32Bytes(ErrorCode.NO_ERROR)));
    this.dropStream(s, "reset");
  }

  private dropStream(s: Stream, how: ClosedHow): void {
    this.streams.delete(s.id);
    this.rememberClosed(s.id, how);
  }

  private rememberClosed(id: number, how: ClosedHow): void {
    this.closedStreams.set(id, how);
    if (this.closedStreams.size > CLOSED_MEMORY) {
      this.closedStreams.delete(this.closedStreams.keys().next().value!);
    }
  }
}

/** Why a request's (or trailers') header list is malformed (8.2, 8.3), or "" when it is not. */
export function checkFields(headers: Header[], trailers: boolean): string {
  const seen = new Set<string>();
  let regular = false;
  for (const [name, value] of headers) {
    if (name.length === 0) return "an empty field name";
    if (/[A-Z]/.test(name)) return `field name ${JSON.stringify(name)} has uppercase letters`;
    if (/[\0\r\n]/.test(value)) return `field ${name} has NUL, CR or LF in its value`;
    if (name[0] === ":") {
      if (trailers) return `pseudo-header ${name} in trailers`;
      if (regular) return `pseudo-header ${name} after a regular field`;
      if (!REQUEST_PSEUDO.has(name)) return `pseudo-header ${name} in a request`;
      if (seen.has(name)) return `pseudo-header ${name} repeated`;
      seen.add(name);
      continue;
    }
    regular = true;
    if (CONNECTION_SPECIFIC.has(name)) return `connection-specific field ${name}`;
    if (name === "te" && value !== "trailers") return `te: ${value}`;
  }
  if (trailers) return "";
  if (!seen.has(":method")) return "no :method";
  const method = headers.find(([n]) => n === ":method")![1];
  if (method === "CONNECT") return seen.has(":authority") ? "" : "CONNECT without :authority";
  if (!seen.has(":scheme") || !seen.has(":path")) return "no :scheme or :path";
  if (headers.find(([n]) => n === ":path")![1] === "") return "empty :path";
  return "";
}
