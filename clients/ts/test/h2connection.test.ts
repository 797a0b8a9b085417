// The sans-IO HTTP/2 server connection (src/h2/connection.ts) fed frames built by hand, its
// answers parsed back: the preface and SETTINGS, CONTINUATION, padding, flow control both ways,
// limits, and the error code of each protocol error.

import assert from "node:assert/strict";
import { describe, test } from "node:test";

import {
  CLIENT_PREFACE,
  ErrorCode,
  Flag,
  FrameType,
  H2ServerConnection,
  H2StreamClosedError,
  Setting,
  encodeFrame,
  type H2Event,
  type H2ServerOptions,
} from "../src/h2/connection.js";
import { HpackDecoder, HpackEncoder, type Header } from "../src/h2/hpack.js";

interface Frame {
  type: number;
  flags: number;
  id: number;
  payload: Uint8Array;
}

function parseFrames(b: Uint8Array): Frame[] {
  const out: Frame[] = [];
  let at = 0;
  while (at < b.length) {
    const len = (b[at]! << 16) | (b[at + 1]! << 8) | b[at + 2]!;
    const id = new DataView(b.buffer, b.byteOffset + at + 5, 4).getUint32(0) & 0x7fffffff;
    out.push({ type: b[at + 3]!, flags: b[at + 4]!, id, payload: b.slice(at + 9, at + 9 + len) });
    at += 9 + len;
  }
  assert.equal(at, b.length, "output ends inside a frame");
  return out;
}

const u32 = (...v: number[]): Uint8Array => {
  const b = new Uint8Array(4 * v.length);
  v.forEach((x, i) => new DataView(b.buffer).setUint32(4 * i, x));
  return b;
};
const getU32 = (b: Uint8Array, at = 0): number => new DataView(b.buffer, b.byteOffset).getUint32(at);

function settingsFrame(pairs: [number, number][] = []): Uint8Array {
  const p = new Uint8Array(6 * pairs.length);
  const v = new DataView(p.buffer);
  pairs.forEach(([k, x], i) => {
    v.setUint16(6 * i, k);
    v.setUint32(6 * i + 2, x);
  });
  return encodeFrame(FrameType.SETTINGS, 0, 0, p);
}

const REQUEST: Header[] = [
  [":method", "POST"],
  [":scheme", "http"],
  [":path", "/kvasir.v1.ExpertService/Describe"],
  [":authority", "hub"],
  ["content-type", "application/grpc"],
  ["te", "trailers"],
];

/** A client: its HPACK encoder, and the server under test with the preface exchanged. */
class Peer {
  readonly conn: H2ServerConnection;
  readonly enc = new HpackEncoder();
  readonly dec = new HpackDecoder();
  /** The server's frames since the last take(). */
  frames: Frame[] = [];

  constructor(opts: H2ServerOptions = {}, settings: [number, number][] = [], ack = true) {
    this.conn = new H2ServerConnection(opts);
    this.send(CLIENT_PREFACE, settingsFrame(settings));
    if (ack) this.send(encodeFrame(FrameType.SETTINGS, Flag.ACK, 0, new Uint8Array(0)));
    this.take();
  }

  send(...chunks: Uint8Array[]): H2Event[] {
    const events: H2Event[] = [];
    for (const c of chunks) events.push(...this.conn.receiveData(c));
    this.frames.push(...parseFrames(this.conn.dataToSend()));
    return events;
  }

  take(): Frame[] {
    const f = this.frames;
    this.frames = [];
    return f;
  }

  headers(id: number, headers: Header[] = REQUEST, flags: number = Flag.END_HEADERS): Uint8Array {
    return encodeFrame(FrameType.HEADERS, flags, id, this.enc.encode(headers));
  }

  /** The last GOAWAY's error code, or undefined. */
  goaway(frames: Frame[]): number | undefined {
    const g = frames.filter((f) => f.type === FrameType.GOAWAY).at(-1);
    return g ? getU32(g.payload, 4) : undefined;
  }

  rst(frames: Frame[], id: number): number | undefined {
    const r = frames.find((f) => f.type === FrameType.RST_STREAM && f.id === id);
    return r ? getU32(r.payload) : undefined;
  }
}

function dataBytes(frames: Frame[], id: number): number {
  return frames.filter((f) => f.type === FrameType.DATA && f.id === id).reduce((a, f) => a + f.payload.length, 0);
}

describe("preface and SETTINGS", () => {
  test("the server's preface: SETTINGS, then the connection window raised", () => {
    const conn = new H2ServerConnection({ maxConcurrentStreams: 7, initialWindowSize: 100_000 });
    const [s, w] = parseFrames(conn.dataToSend());
    assert.equal(s!.type, FrameType.SETTINGS);
    const pairs = new Map<number, number>();
    for (let i = 0; i < s!.payload.length; i += 6) {
      pairs.set((s!.payload[i]! << 8) | s!.payload[i + 1]!, getU32(s!.payload, i + 2));
    }
    assert.equal(pairs.get(Setting.MAX_CONCURRENT_STREAMS), 7);
    assert.equal(pairs.get(Setting.INITIAL_WINDOW_SIZE), 100_000);
    assert.equal(pairs.get(Setting.ENABLE_PUSH), 0);
    assert.equal(w!.type, FrameType.WINDOW_UPDATE);
    assert.equal(getU32(w!.payload), (16 << 20) - 65535);
  });

  test("the client's SETTINGS is applied and acknowledged; our ACK arrives", () => {
    const conn = new H2ServerConnection();
    conn.dataToSend();
    // The preface one byte at a time: nothing happens until it is whole.
    for (const b of CLIENT_PREFACE) assert.deepEqual(conn.receiveData(Uint8Array.of(b)), []);
    const ev = conn.receiveData(settingsFrame([[Setting.MAX_FRAME_SIZE, 32768]]));
    assert.equal(ev[0]!.type, "settings");
    const [ack] = parseFrames(conn.dataToSend());
    assert.equal(ack!.type, FrameType.SETTINGS);
    assert.equal(ack!.flags, Flag.ACK);
    const acked = conn.receiveData(encodeFrame(FrameType.SETTINGS, Flag.ACK, 0, new Uint8Array(0)));
    assert.equal(acked[0]!.type, "settingsAcked");
  });

  test("a bad preface: GOAWAY PROTOCOL_ERROR, and nothing more is read", () => {
    const conn = new H2ServerConnection();
    conn.dataToSend();
    const ev = conn.receiveData(new TextEncoder().encode("GET / HTTP/1.1\r\n\r\n"));
    assert.deepEqual(ev.map((e) => e.type), ["connectionError"]);
    const frames = parseFrames(conn.dataToSend());
    assert.equal(frames.length, 1);
    assert.equal(getU32(frames[0]!.payload, 4), ErrorCode.PROTOCOL_ERROR);
    assert.ok(conn.isClosed);
    assert.deepEqual(conn.receiveData(CLIENT_PREFACE), []);
  });

  test("a preface not followed by SETTINGS: PROTOCOL_ERROR", () => {
    const conn = new H2ServerConnection();
    conn.receiveData(CLIENT_PREFACE);
    const ev = conn.receiveData(encodeFrame(FrameType.PING, 0, 0, new Uint8Array(8)));
    assert.equal(ev.at(-1)!.type, "connectionError");
  });

  test("bad SETTINGS: length, stream, values", () => {
    const cases: [Uint8Array, number][] = [
      [encodeFrame(FrameType.SETTINGS, 0, 0, new Uint8Array(5)), ErrorCode.FRAME_SIZE_ERROR],
      [encodeFrame(FrameType.SETTINGS, 0, 1, new Uint8Array(0)), ErrorCode.PROTOCOL_ERROR],
      [encodeFrame(FrameType.SETTINGS, Flag.ACK, 0, new Uint8Array(6)), ErrorCode.FRAME_SIZE_ERROR],
      [settingsFrame([[Setting.ENABLE_PUSH, 2]]), ErrorCode.PROTOCOL_ERROR],
      [settingsFrame([[Setting.INITIAL_WINDOW_SIZE, 2 ** 31]]), ErrorCode.FLOW_CONTROL_ERROR],
      [settingsFrame([[Setting.MAX_FRAME_SIZE, 16383]]), ErrorCode.PROTOCOL_ERROR],
      [settingsFrame([[Setting.MAX_FRAME_SIZE, 2 ** 24]]), ErrorCode.PROTOCOL_ERROR],
    ];
    for (const [frame, code] of cases) {
      const p = new Peer();
      p.send(frame);
      assert.equal(p.goaway(p.take()), code);
    }
  });
});

describe("requests", () => {
  test("HEADERS with two CONTINUATIONs: one request", () => {
    const p = new Peer();
    const block = p.enc.encode(REQUEST);
    const a = block.subarray(0, 5);
    const b = block.subarray(5, 12);
    const c = block.subarray(12);
    const ev = p.send(
      encodeFrame(FrameType.HEADERS, Flag.END_STREAM, 1, a),
      encodeFrame(FrameType.CONTINUATION, 0, 1, b),
      encodeFrame(FrameType.CONTINUATION, Flag.END_HEADERS, 1, c),
    );
    assert.deepEqual(ev, [
      { type: "request", streamId: 1, headers: REQUEST, endStream: true },
      { type: "streamEnded", streamId: 1 },
    ]);
  });

  test("a frame inside a header block, and a CONTINUATION out of place: PROTOCOL_ERROR", () => {
    let p = new Peer();
    p.send(encodeFrame(FrameType.HEADERS, 0, 1, p.enc.encode(REQUEST).subarray(0, 4)));
    p.send(encodeFrame(FrameType.PING, 0, 0, new Uint8Array(8)));
    assert.equal(p.goaway(p.take()), ErrorCode.PROTOCOL_ERROR);
    p = new Peer();
    p.send(encodeFrame(FrameType.CONTINUATION, Flag.END_HEADERS, 1, new Uint8Array(1)));
    assert.equal(p.goaway(p.take()), ErrorCode.PROTOCOL_ERROR);
  });

  test("padded HEADERS (with priority) and padded DATA; the padding's window comes back", () => {
    const p = new Peer({ initialWindowSize: 300, connectionWindowSize: 65535 });
    const block = p.enc.encode(REQUEST);
    const hp = new Uint8Array(1 + 5 + block.length + 3);
    hp[0] = 3;
    hp.set(u32(0), 1);
    hp[5] = 16;
    hp.set(block, 6);
    let ev = p.send(encodeFrame(FrameType.HEADERS, Flag.END_HEADERS | Flag.PADDED | Flag.PRIORITY, 1, hp));
    assert.equal(ev[0]!.type, "request");
    const dp = new Uint8Array(1 + 10 + 200);
    dp[0] = 200;
    dp.fill(7, 1, 11);
    ev = p.send(encodeFrame(FrameType.DATA, Flag.PADDED, 1, dp));
    const data = ev[0] as Extract<H2Event, { type: "data" }>;
    assert.deepEqual(data.data, new Uint8Array(10).fill(7));
    assert.equal(data.flowControlledLength, 10);
    // 201 bytes of padding and pad length: over half the stream's window of 300, returned at once.
    const wu = p.take().filter((f) => f.type === FrameType.WINDOW_UPDATE && f.id === 1);
    assert.deepEqual(wu.map((f) => getU32(f.payload)), [201]);
  });

  test("padding that fills the frame: PROTOCOL_ERROR", () => {
    const p = new Peer();
    p.send(p.headers(1));
    p.send(encodeFrame(FrameType.DATA, Flag.PADDED, 1, Uint8Array.of(4, 0, 0, 0)));
    assert.equal(p.goaway(p.take()), ErrorCode.PROTOCOL_ERROR);
  });

  test("a frame over SETTINGS_MAX_FRAME_SIZE: GOAWAY FRAME_SIZE_ERROR", () => {
    const p = new Peer();
    p.send(p.headers(1));
    const ev = p.send(encodeFrame(FrameType.DATA, 0, 1, new Uint8Array(16385)));
    assert.equal(ev.at(-1)!.type, "connectionError");
    assert.equal(p.goaway(p.take()), ErrorCode.FRAME_SIZE_ERROR);
    // A larger limit of our own takes it.
    const q = new Peer({ maxFrameSize: 1 << 20 });
    q.send(q.headers(1));
    const ev2 = q.send(encodeFrame(FrameType.DATA, 0, 1, new Uint8Array(16385)));
    assert.equal(ev2[0]!.type, "data");
  });

  test("protocol errors on streams: even id, idle DATA, HPACK garbage, stream 0", () => {
    const cases: [(p: Peer) => Uint8Array, number][] = [
      [(p) => p.headers(2), ErrorCode.PROTOCOL_ERROR],
      [() => encodeFrame(FrameType.DATA, 0, 5, new Uint8Array(1)), ErrorCode.PROTOCOL_ERROR],
      [() => encodeFrame(FrameType.HEADERS, Flag.END_HEADERS, 1, Uint8Array.of(0x80)), ErrorCode.COMPRESSION_ERROR],
      [() => encodeFrame(FrameType.DATA, 0, 0, new Uint8Array(1)), ErrorCode.PROTOCOL_ERROR],
      [() => encodeFrame(FrameType.PUSH_PROMISE, Flag.END_HEADERS, 1, new Uint8Array(4)), ErrorCode.PROTOCOL_ERROR],
      [() => encodeFrame(FrameType.RST_STREAM, 0, 9, u32(0)), ErrorCode.PROTOCOL_ERROR],
      [() => encodeFrame(FrameType.WINDOW_UPDATE, 0, 0, u32(0)), ErrorCode.PROTOCOL_ERROR],
      [() => encodeFrame(FrameType.PING, 0, 0, new Uint8Array(7)), ErrorCode.FRAME_SIZE_ERROR],
      [() => encodeFrame(FrameType.GOAWAY, 0, 1, new Uint8Array(8)), ErrorCode.PROTOCOL_ERROR],
    ];
    for (const [make, code] of cases) {
      const p = new Peer();
      p.send(make(p));
      assert.equal(p.goaway(p.take()), code, make.toString());
    }
  });

  test("HEADERS on a stream lower than the last opened (and closed): STREAM_CLOSED", () => {
    const p = new Peer();
    p.send(p.headers(3, REQUEST, Flag.END_HEADERS | Flag.END_STREAM));
    p.conn.sendHeaders(3, [[":status", "200"]], true);
    p.send(p.headers(1));
    assert.equal(p.goaway(p.take()), ErrorCode.STREAM_CLOSED);
  });

  test("malformed requests: RST_STREAM PROTOCOL_ERROR, the connection lives on", () => {
    const p = new Peer();
    const bad: Header[][] = [
      [[":method", "POST"], [":scheme", "http"]],
      [...REQUEST, ["Content-Type", "x"]],
      [...REQUEST, ["connection", "close"]],
      [...REQUEST, [":path", "/again"]],
      [["content-type", "x"], ...REQUEST],
      [...REQUEST.slice(0, 5), ["te", "gzip"]],
    ];
    bad.forEach((h, i) => {
      const id = 1 + 2 * i;
      const ev = p.send(p.headers(id, h));
      assert.equal(ev[0]!.type, "streamReset", JSON.stringify(h));
      assert.equal(p.rst(p.take(), id), ErrorCode.PROTOCOL_ERROR);
    });
    assert.equal(p.send(p.headers(101))[0]!.type, "request");
  });

  test("trailers end the request; trailers without END_STREAM reset the stream", () => {
    const p = new Peer();
    p.send(p.headers(1));
    const trailers = p.enc.encode([["x-t", "1"]]);
    const ev = p.send(encodeFrame(FrameType.HEADERS, Flag.END_HEADERS | Flag.END_STREAM, 1, trailers));
    assert.deepEqual(ev.map((e) => e.type), ["trailers", "streamEnded"]);
    p.send(p.headers(3));
    p.send(encodeFrame(FrameType.HEADERS, Flag.END_HEADERS, 3, p.enc.encode([["x-t", "1"]])));
    assert.equal(p.rst(p.take(), 3), ErrorCode.PROTOCOL_ERROR);
  });

  test("DATA after END_STREAM: STREAM_CLOSED", () => {
    const p = new Peer();
    p.send(p.headers(1, REQUEST, Flag.END_HEADERS | Flag.END_STREAM));
    p.send(encodeFrame(FrameType.DATA, 0, 1, new Uint8Array(1)));
    assert.equal(p.rst(p.take(), 1), ErrorCode.STREAM_CLOSED);
  });

  test("PRIORITY is ignored; a bad one resets its stream; a stream depending on itself too", () => {
    const p = new Peer();
    assert.deepEqual(p.send(encodeFrame(FrameType.PRIORITY, 0, 1, Uint8Array.of(0, 0, 0, 3, 16))), []);
    assert.deepEqual(p.take(), []);
    p.send(encodeFrame(FrameType.PRIORITY, 0, 1, new Uint8Array(4)));
    assert.equal(p.rst(p.take(), 1), ErrorCode.FRAME_SIZE_ERROR);
    const block = p.enc.encode(REQUEST);
    const hp = new Uint8Array(5 + block.length);
    hp.set(u32(3), 0);
    hp.set(block, 5);
    p.send(encodeFrame(FrameType.HEADERS, Flag.END_HEADERS | Flag.PRIORITY, 3, hp));
    assert.equal(p.rst(p.take(), 3), ErrorCode.PROTOCOL_ERROR);
    // The block was decoded all the same: HPACK is still in step.
    assert.equal(p.send(p.headers(5))[0]!.type, "request");
  });

  test("SETTINGS_MAX_CONCURRENT_STREAMS: the stream over it is refused", () => {
    const p = new Peer({ maxConcurrentStreams: 2 });
    p.send(p.headers(1), p.headers(3));
    const ev = p.send(p.headers(5));
    assert.equal(ev[0]!.type, "streamReset");
    assert.equal(p.rst(p.take(), 5), ErrorCode.REFUSED_STREAM);
    p.send(encodeFrame(FrameType.RST_STREAM, 0, 1, u32(ErrorCode.CANCEL)));
    assert.equal(p.send(p.headers(7))[0]!.type, "request");
  });

  test("a header list over SETTINGS_MAX_HEADER_LIST_SIZE: 431", () => {
    const p = new Peer({ maxHeaderListSize: 400 });
    p.send(p.headers(1, [...REQUEST, ["x-big", "b".repeat(400)]], Flag.END_HEADERS | Flag.END_STREAM));
    const [h] = p.take();
    assert.equal(h!.type, FrameType.HEADERS);
    assert.deepEqual(p.dec.decode(h!.payload), [[":status", "431"]]);
    const ev = p.send(p.headers(3));
    assert.equal(ev[0]!.type, "request", JSON.stringify(ev));
  });

  test("the client's RST_STREAM: an event, and the stream takes nothing more", () => {
    const p = new Peer();
    p.send(p.headers(1));
    const ev = p.send(encodeFrame(FrameType.RST_STREAM, 0, 1, u32(ErrorCode.CANCEL)));
    assert.deepEqual(ev, [{ type: "streamReset", streamId: 1, errorCode: ErrorCode.CANCEL, remote: true }]);
    assert.throws(() => p.conn.sendData(1, new Uint8Array(1)), H2StreamClosedError);
    assert.equal(p.conn.isStreamWritable(1), false);
    // Frames the client sent before it knew: DATA is ignored (its window returned), so is WINDOW_UPDATE.
    assert.deepEqual(p.send(encodeFrame(FrameType.WINDOW_UPDATE, 0, 1, u32(10))), []);
  });

  test("PING is answered with its payload; GOAWAY from the client is reported", () => {
    const p = new Peer();
    const data = new TextEncoder().encode("12345678");
    const ev = p.send(encodeFrame(FrameType.PING, 0, 0, data));
    assert.deepEqual(ev, [{ type: "ping", data }]);
    const [ack] = p.take();
    assert.equal(ack!.flags, Flag.ACK);
    assert.deepEqual(ack!.payload, data);
    const g = p.send(encodeFrame(FrameType.GOAWAY, 0, 0, Uint8Array.of(...u32(0, 0), 104, 105)));
    assert.deepEqual(g, [{ type: "goaway", errorCode: 0, lastStreamId: 0, debug: Uint8Array.of(104, 105) }]);
  });

  test("our GOAWAY names the last stream; streams opened after it are ignored", () => {
    const p = new Peer();
    p.send(p.headers(1));
    p.conn.goAway(ErrorCode.NO_ERROR, "bye");
    p.send();
    const [g] = p.take();
    assert.equal(getU32(g!.payload), 1);
    assert.deepEqual(p.send(p.headers(3)), []);
  });
});

describe("flow control", () => {
  test("DATA is held when the stream's window is spent, released by WINDOW_UPDATE, trailers after it", () => {
    const p = new Peer({}, [[Setting.INITIAL_WINDOW_SIZE, 100]]);
    p.send(p.headers(1, REQUEST, Flag.END_HEADERS | Flag.END_STREAM));
    p.take();
    p.conn.sendHeaders(1, [[":status", "200"]]);
    p.conn.sendData(1, new Uint8Array(250).fill(1));
    p.conn.sendHeaders(1, [["grpc-status", "0"]], true);
    p.send();
    let f = p.take();
    assert.deepEqual(f.map((x) => x.type), [FrameType.HEADERS, FrameType.DATA]);
    assert.equal(dataBytes(f, 1), 100);
    assert.equal(p.conn.localFlowControlWindow(1), 0);
    assert.equal(p.conn.queuedBytes(1), 150);
    p.send(encodeFrame(FrameType.WINDOW_UPDATE, 0, 1, u32(100)));
    f = p.take();
    assert.equal(dataBytes(f, 1), 100);
    assert.equal(f.some((x) => x.type === FrameType.HEADERS), false, "trailers before the data");
    // A larger INITIAL_WINDOW_SIZE opens the window of the streams already open.
    p.send(settingsFrame([[Setting.INITIAL_WINDOW_SIZE, 150]]));
    f = p.take();
    assert.deepEqual(f.map((x) => x.type), [FrameType.SETTINGS, FrameType.DATA, FrameType.HEADERS]);
    assert.equal(dataBytes(f, 1), 50);
    assert.equal(f[2]!.flags & Flag.END_STREAM, Flag.END_STREAM);
    assert.deepEqual(p.dec.decode(f[2]!.payload), [["grpc-status", "0"]]);
  });

  test("the connection's window: streams wait for WINDOW_UPDATE on stream 0; frames of at most 16384", () => {
    const p = new Peer({}, [[Setting.INITIAL_WINDOW_SIZE, 1 << 20]]);
    const whole = Flag.END_HEADERS | Flag.END_STREAM;
    p.send(p.headers(1, REQUEST, whole), p.headers(3, REQUEST, whole));
    p.take();
    p.conn.sendData(1, new Uint8Array(50_000), true);
    p.conn.sendData(3, new Uint8Array(50_000), true);
    let f = p.take().concat(p.send() && p.take());
    assert.equal(dataBytes(f, 1) + dataBytes(f, 3), 65535);
    assert.ok(f.every((x) => x.payload.length <= 16384));
    assert.ok(dataBytes(f, 1) > 0 && dataBytes(f, 3) > 0, "both streams served in turn");
    p.send(encodeFrame(FrameType.WINDOW_UPDATE, 0, 0, u32(1 << 20)));
    f = p.take();
    assert.equal(dataBytes(f, 1) + dataBytes(f, 3), 100_000 - 65535);
    assert.equal(p.conn.openStreams, 0);
  });

  test("a smaller INITIAL_WINDOW_SIZE makes a window negative: DATA waits until it is positive again", () => {
    const p = new Peer({}, [[Setting.INITIAL_WINDOW_SIZE, 100]]);
    p.send(p.headers(1, REQUEST, Flag.END_HEADERS | Flag.END_STREAM));
    p.take();
    p.conn.sendData(1, new Uint8Array(100));
    p.send(settingsFrame([[Setting.INITIAL_WINDOW_SIZE, 50]])); // the window: 100 - 100 - 50 = -50
    p.conn.sendData(1, new Uint8Array(10), true);
    p.send(encodeFrame(FrameType.WINDOW_UPDATE, 0, 1, u32(55)));
    let f = p.take();
    assert.equal(dataBytes(f, 1), 100 + 5);
    assert.equal(f.some((x) => x.type === FrameType.DATA && x.flags & Flag.END_STREAM), false);
    p.send(encodeFrame(FrameType.WINDOW_UPDATE, 0, 1, u32(5)));
    f = p.take();
    assert.equal(dataBytes(f, 1), 5);
    assert.equal(f.at(-1)!.flags & Flag.END_STREAM, Flag.END_STREAM);
  });

  test("WINDOW_UPDATE overflowing 2^31-1: stream and connection errors", () => {
    const p = new Peer();
    p.send(p.headers(1));
    p.send(encodeFrame(FrameType.WINDOW_UPDATE, 0, 1, u32(2 ** 31 - 1)));
    assert.equal(p.rst(p.take(), 1), ErrorCode.FLOW_CONTROL_ERROR);
    p.send(encodeFrame(FrameType.WINDOW_UPDATE, 0, 0, u32(2 ** 31 - 1)));
    assert.equal(p.goaway(p.take()), ErrorCode.FLOW_CONTROL_ERROR);
  });

  test("the client overrunning our windows: FLOW_CONTROL_ERROR (stream, then connection)", () => {
    const p = new Peer({ initialWindowSize: 1000, connectionWindowSize: 65535 });
    p.send(p.headers(1));
    p.send(encodeFrame(FrameType.DATA, 0, 1, new Uint8Array(1001)));
    assert.equal(p.rst(p.take(), 1), ErrorCode.FLOW_CONTROL_ERROR);
    // Never acknowledged: the connection's window is spent by streams 3, 5, ... of 1000 bytes each.
    let id = 3;
    for (let sent = 1001; sent + 1000 <= 65535; sent += 1000, id += 2) {
      p.send(p.headers(id), encodeFrame(FrameType.DATA, 0, id, new Uint8Array(1000)));
    }
    assert.equal(p.goaway(p.take()), undefined);
    p.send(p.headers(id), encodeFrame(FrameType.DATA, 0, id, new Uint8Array(1000)));
    assert.equal(p.goaway(p.take()), ErrorCode.FLOW_CONTROL_ERROR);
  });

  test("our initial window applies from the client's ACK: 65535 before it", () => {
    const p = new Peer({ initialWindowSize: 1000 }, [], false);
    p.send(p.headers(1));
    p.send(encodeFrame(FrameType.DATA, 0, 1, new Uint8Array(5000)));
    assert.equal(p.rst(p.take(), 1), undefined);
    p.send(encodeFrame(FrameType.SETTINGS, Flag.ACK, 0, new Uint8Array(0)));
    // Its window is now 1000 - 5000: nothing more fits.
    p.send(encodeFrame(FrameType.DATA, 0, 1, new Uint8Array(1)));
    assert.equal(p.rst(p.take(), 1), ErrorCode.FLOW_CONTROL_ERROR);
  });

  test("acknowledged data returns as WINDOW_UPDATE once half a window is consumed", () => {
    const p = new Peer({ initialWindowSize: 10_000, connectionWindowSize: 100_000 });
    p.send(p.headers(1));
    p.take();
    p.send(encodeFrame(FrameType.DATA, 0, 1, new Uint8Array(4000)));
    p.conn.acknowledgeReceivedData(1, 4000);
    assert.deepEqual(p.take().concat(p.send() && p.take()), []);
    p.send(encodeFrame(FrameType.DATA, 0, 1, new Uint8Array(2000)));
    p.conn.acknowledgeReceivedData(1, 2000);
    p.send();
    const wu = p.take();
    assert.deepEqual(wu.map((f) => [f.id, getU32(f.payload)]), [[1, 6000]]);
    for (let i = 0; i < 9; i++) {
      p.send(encodeFrame(FrameType.DATA, 0, 1, new Uint8Array(6000)));
      p.conn.acknowledgeReceivedData(1, 6000);
    }
    p.send();
    const conn = p.take().filter((f) => f.id === 0);
    assert.deepEqual(conn.map((f) => getU32(f.payload)), [54_000]);
  });
});

describe("HPACK on the connection", () => {
  test("the client's SETTINGS_HEADER_TABLE_SIZE 0: our next block starts with a size update", () => {
    const p = new Peer({}, [[Setting.HEADER_TABLE_SIZE, 0]]);
    p.send(p.headers(1, REQUEST, Flag.END_HEADERS | Flag.END_STREAM));
    p.conn.sendHeaders(1, [[":status", "200"], ["content-type", "application/grpc"]], true);
    p.send();
    const [h] = p.take();
    assert.equal(h!.payload[0], 0x20);
    assert.equal(p.dec.decode(h!.payload).length, 2);
    assert.equal(p.dec.table.length, 0);
  });

  test("a header block larger than the peer's frame size goes out as HEADERS + CONTINUATION", () => {
    const p = new Peer();
    p.send(p.headers(1, REQUEST, Flag.END_HEADERS | Flag.END_STREAM));
    const big: Header[] = [[":status", "200"], ["x-a", "~".repeat(20_000)], ["x-b", "}".repeat(20_000)]];
    p.conn.sendHeaders(1, big, true);
    p.send();
    const f = p.take();
    assert.deepEqual(f.map((x) => x.type), [FrameType.HEADERS, FrameType.CONTINUATION, FrameType.CONTINUATION]);
    assert.equal(f[0]!.flags, Flag.END_STREAM);
    assert.equal(f[2]!.flags, Flag.END_HEADERS);
    const block = new Uint8Array(f.reduce((a, x) => a + x.payload.length, 0));
    let at = 0;
    for (const x of f) {
      block.set(x.payload, at);
      at += x.payload.length;
    }
    assert.deepEqual(p.dec.decode(block), big);
  });
});
