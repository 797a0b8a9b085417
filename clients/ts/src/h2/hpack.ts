// HPACK (RFC 7541): header compression for HTTP/2. Plain TypeScript over Uint8Array, no
// Node-only API: it runs in a browser as well as in Node.
//
// A header is [name, value]; names and values are UTF-8 strings (HTTP/2 fields are ASCII in
// practice; gRPC's binary metadata travels base64). Sizes (table entries, header list) count
// the UTF-8 bytes, as the RFC counts octets.

import { HUFFMAN_CODES, HUFFMAN_LENGTHS } from "./huffman.js";

export type Header = [name: string, value: string];

/** A header block that does not decode: the HTTP/2 connection answers COMPRESSION_ERROR. */
export class HpackError extends Error {
  override name = "HpackError";
}

/** The decoded header list is larger than the decoder's limit. The whole block was decoded (the
 * dynamic table stays in step with the peer's), so only the stream it belongs to need fail. */
export class HeaderListTooLargeError extends Error {
  override name = "HeaderListTooLargeError";
  constructor(
    readonly size: number,
    readonly limit: number,
  ) {
    super(`header list of ${size} bytes, over the limit of ${limit}`);
  }
}

/** RFC 7541 Appendix A. Index 1 is STATIC_TABLE[0]. */
export const STATIC_TABLE: readonly Header[] = [
  [":authority", ""], [":method", "GET"], [":method", "POST"], [":path", "/"], [":path", "/index.html"],
  [":scheme", "http"], [":scheme", "https"], [":status", "200"], [":status", "204"], [":status", "206"],
  [":status", "304"], [":status", "400"], [":status", "404"], [":status", "500"], ["accept-charset", ""],
  ["accept-encoding", "gzip, deflate"], ["accept-language", ""], ["accept-ranges", ""], ["accept", ""],
  ["access-control-allow-origin", ""], ["age", ""], ["allow", ""], ["authorization", ""], ["cache-control", ""],
  ["content-disposition", ""], ["content-encoding", ""], ["content-language", ""], ["content-length", ""],
  ["content-location", ""], ["content-range", ""], ["content-type", ""], ["cookie", ""], ["date", ""],
  ["etag", ""], ["expect", ""], ["expires", ""], ["from", ""], ["host", ""], ["if-match", ""],
  ["if-modified-since", ""], ["if-none-match", ""], ["if-range", ""], ["if-unmodified-since", ""],
  ["last-modified", ""], ["link", ""], ["location", ""], ["max-forwards", ""], ["proxy-authenticate", ""],
  ["proxy-authorization", ""], ["range", ""], ["referer", ""], ["refresh", ""], ["retry-after", ""],
  ["server", ""], ["set-cookie", ""], ["strict-transport-security", ""], ["transfer-encoding", ""],
  ["user-agent", ""], ["vary", ""], ["via", ""], ["www-authenticate", ""],
];

/** The size of a table entry (4.1): its octets plus 32. */
const ENTRY_OVERHEAD = 32;

const utf8 = new TextEncoder();
const utf8Decoder = new TextDecoder("utf-8");

// Static table look-ups for the encoder: the first index of each name and of each pair.
const STATIC_NAME = new Map<string, number>();
const STATIC_PAIR = new Map<string, number>();
STATIC_TABLE.forEach(([n, v], i) => {
  if (!STATIC_NAME.has(n)) STATIC_NAME.set(n, i + 1);
  STATIC_PAIR.set(`${n}\0${v}`, i + 1);
});

interface Entry {
  name: string;
  value: string;
  size: number;
}

/** The dynamic table (2.3.2, 4): newest entry first, evicting the oldest beyond `maxSize`. */
export class DynamicTable {
  private entries: Entry[] = [];
  size = 0;

  constructor(public maxSize: number) {}

  get length(): number {
    return this.entries.length;
  }

  /** Entry `i` (0: the newest), or undefined. */
  at(i: number): Entry | undefined {
    return this.entries[i];
  }

  add(name: string, value: string, octets: number): void {
    const size = octets + ENTRY_OVERHEAD;
    if (size > this.maxSize) {
      // An entry larger than the table empties it and is not added (4.4).
      this.entries = [];
      this.size = 0;
      return;
    }
    this.entries.unshift({ name, value, size });
    this.size += size;
    this.evict();
  }

  resize(maxSize: number): void {
    this.maxSize = maxSize;
    this.evict();
  }

  private evict(): void {
    while (this.size > this.maxSize) this.size -= this.entries.pop()!.size;
  }
}

// -- Huffman code (5.2, Appendix B) ----------------------------------------------------------

// The decoding tree: node n's children are TREE[2n] (bit 0) and TREE[2n + 1] (bit 1); a child
// >= 0 is a node, -1 is no code, and -2 - s is the leaf of symbol s.
const TREE = buildTree();

function buildTree(): Int32Array {
  const children: number[] = [-1, -1];
  for (let sym = 0; sym < HUFFMAN_CODES.length; sym++) {
    const code = HUFFMAN_CODES[sym]!;
    const len = HUFFMAN_LENGTHS[sym]!;
    let node = 0;
    for (let b = len - 1; b >= 0; b--) {
      const slot = 2 * node + ((code >>> b) & 1);
      if (b === 0) {
        children[slot] = -2 - sym;
      } else {
        if (children[slot] === -1) {
          children[slot] = children.length / 2;
          children.push(-1, -1);
        }
        node = children[slot]!;
      }
    }
  }
  return Int32Array.from(children);
}

const EOS = 256;

/** Decode a Huffman-coded string (5.2): the padding must be at most 7 bits, all ones, and EOS
 * must not appear. */
export function huffmanDecode(data: Uint8Array): Uint8Array {
  const out = new Uint8Array(Math.ceil((data.length * 8) / 5)); // the shortest code is 5 bits
  let n = 0;
  let node = 0;
  let depth = 0; // bits since the last symbol
  let ones = true; // all of them 1
  for (let i = 0; i < data.length; i++) {
    const byte = data[i]!;
    for (let b = 7; b >= 0; b--) {
      const bit = (byte >>> b) & 1;
      const next = TREE[2 * node + bit]!;
      if (next === -1) throw new HpackError("Huffman string holds an invalid code");
      if (next < -1) {
        const sym = -2 - next;
        if (sym === EOS) throw new HpackError("Huffman string holds EOS");
        out[n++] = sym;
        node = 0;
        depth = 0;
        ones = true;
      } else {
        node = next;
        depth += 1;
        ones &&= bit === 1;
      }
    }
  }
  if (depth > 7) throw new HpackError("Huffman padding longer than 7 bits");
  if (!ones) throw new HpackError("Huffman padding is not the EOS prefix");
  return out.subarray(0, n);
}

/** The Huffman code of `data`, padded with ones (5.2). */
export function huffmanEncode(data: Uint8Array): Uint8Array {
  const out = new Uint8Array(huffmanLength(data));
  let n = 0;
  let acc = 0; // pending bits, at most 7 + 30
  let bits = 0;
  for (let i = 0; i < data.length; i++) {
    const sym = data[i]!;
    const len = HUFFMAN_LENGTHS[sym]!;
    const code = HUFFMAN_CODES[sym]!;
    // acc holds < 8 bits here; appending up to 30 stays within 2^53 with multiplication.
    acc = acc * 2 ** len + code;
    bits += len;
    while (bits >= 8) {
      bits -= 8;
      const byte = Math.floor(acc / 2 ** bits);
      out[n++] = byte & 0xff;
      acc -= byte * 2 ** bits;
    }
  }
  if (bits > 0) out[n++] = ((acc << (8 - bits)) | (0xff >>> bits)) & 0xff;
  return out;
}

/** The length in bytes of the Huffman code of `data`. */
export function huffmanLength(data: Uint8Array): number {
  let bits = 0;
  for (let i = 0; i < data.length; i++) bits += HUFFMAN_LENGTHS[data[i]!]!;
  return Math.ceil(bits / 8);
}

// -- primitives (5.1, 5.2) ----------------------------------------------------------------

/** The largest integer a decoder takes (larger ones are an error rather than a precision loss). */
const MAX_INTEGER = 2 ** 32 - 1;

class Reader {
  at = 0;
  constructor(readonly data: Uint8Array) {}

  get done(): boolean {
    return this.at >= this.data.length;
  }

  integer(prefixBits: number): number {
    const max = (1 << prefixBits) - 1;
    if (this.done) throw new HpackError("header block truncated in an integer");
    let value = this.data[this.at++]! & max;
    if (value < max) return value;
    let shift = 0;
    for (;;) {
      if (this.done) throw new HpackError("header block truncated in an integer");
      const b = this.data[this.at++]!;
      value += (b & 0x7f) * 2 ** shift;
      shift += 7;
      if (value > MAX_INTEGER) throw new HpackError("integer too large");
      if ((b & 0x80) === 0) return value;
    }
  }

  /** A string literal's octets. */
  string(): Uint8Array {
    if (this.done) throw new HpackError("header block truncated in a string");
    const huffman = (this.data[this.at]! & 0x80) !== 0;
    const len = this.integer(7);
    if (len > this.data.length - this.at) throw new HpackError("string literal runs past the header block");
    const raw = this.data.subarray(this.at, this.at + len);
    this.at += len;
    return huffman ? huffmanDecode(raw) : raw;
  }
}

class Writer {
  private buf = new Uint8Array(256);
  length = 0;

  private room(n: number): void {
    if (this.length + n <= this.buf.length) return;
    const next = new Uint8Array(Math.max(this.buf.length * 2, this.length + n));
    next.set(this.buf.subarray(0, this.length));
    this.buf = next;
  }

  /** An integer with an N-bit prefix; `flags` fills the bits above it. */
  integer(value: number, prefixBits: number, flags: number): void {
    this.room(8);
    const max = (1 << prefixBits) - 1;
    if (value < max) {
      this.buf[this.length++] = flags | value;
      return;
    }
    this.buf[this.length++] = flags | max;
    value -= max;
    while (value >= 128) {
      this.buf[this.length++] = (value % 128) | 0x80;
      value = Math.floor(value / 128);
    }
    this.buf[this.length++] = value;
  }

  bytes(b: Uint8Array): void {
    this.room(b.length);
    this.buf.set(b, this.length);
    this.length += b.length;
  }

  /** A string literal, Huffman-coded when that is shorter (`huffman` true) . */
  string(s: Uint8Array, huffman: boolean): void {
    if (huffman) {
      const hl = huffmanLength(s);
      if (hl <= s.length) {
        this.integer(hl, 7, 0x80);
        this.bytes(huffmanEncode(s));
        return;
      }
    }
    this.integer(s.length, 7, 0);
    this.bytes(s);
  }

  result(): Uint8Array {
    return this.buf.slice(0, this.length);
  }
}

// -- decoder ------------------------------------------------------------------------------

export interface DecoderOptions {
  /** SETTINGS_HEADER_TABLE_SIZE this side announces: the most the peer's encoder may use (4096). */
  maxTableSize?: number;
  /** The largest header list taken (RFC 9113 6.5.2 counting), or Infinity (default 64 KiB). */
  maxHeaderListSize?: number;
}

export class HpackDecoder {
  readonly table: DynamicTable;
  /** The most the peer may set the table's size to: our SETTINGS_HEADER_TABLE_SIZE. */
  maxAllowedTableSize: number;
  maxHeaderListSize: number;

  constructor(opts: DecoderOptions = {}) {
    this.maxAllowedTableSize = opts.maxTableSize ?? 4096;
    this.maxHeaderListSize = opts.maxHeaderListSize ?? 65536;
    this.table = new DynamicTable(this.maxAllowedTableSize);
  }

  private entry(index: number): Header {
    if (index === 0) throw new HpackError("index 0");
    if (index <= STATIC_TABLE.length) return STATIC_TABLE[index - 1]!;
    const e = this.table.at(index - STATIC_TABLE.length - 1);
    if (e === undefined) throw new HpackError(`index ${index} past the end of the tables`);
    return [e.name, e.value];
  }

  /** Decode one complete header block. Throws HpackError (the connection is then unusable:
   * COMPRESSION_ERROR) or, after decoding all of it, HeaderListTooLargeError. */
  decode(block: Uint8Array): Header[] {
    const r = new Reader(block);
    const headers: Header[] = [];
    let listSize = 0;
    let sawField = false;
    while (!r.done) {
      const b = block[r.at]!;
      let name: string;
      let value: string;
      let octets: number;
      if (b & 0x80) {
        // 6.1 indexed header field
        [name, value] = this.entry(r.integer(7));
        octets = utf8.encode(name).length + utf8.encode(value).length;
      } else if ((b & 0xe0) === 0x20) {
        // 6.3 dynamic table size update: only at the start of a block (4.2)
        if (sawField) throw new HpackError("dynamic table size update after a header field");
        const size = r.integer(5);
        if (size > this.maxAllowedTableSize) {
          throw new HpackError(`dynamic table size update to ${size}, over the limit of ${this.maxAllowedTableSize}`);
        }
        this.table.resize(size);
        continue;
      } else {
        // 6.2 literals: with incremental indexing (01), without (0000), never indexed (0001)
        const indexing = (b & 0xc0) === 0x40;
        const index = r.integer(indexing ? 6 : 4);
        let nameBytes: Uint8Array;
        if (index === 0) {
          nameBytes = r.string();
          name = utf8Decoder.decode(nameBytes);
        } else {
          name = this.entry(index)[0];
          nameBytes = utf8.encode(name);
        }
        const valueBytes = r.string();
        value = utf8Decoder.decode(valueBytes);
        octets = nameBytes.length + valueBytes.length;
        if (indexing) this.table.add(name, value, octets);
      }
      sawField = true;
      listSize += octets + ENTRY_OVERHEAD;
      if (listSize <= this.maxHeaderListSize) headers.push([name, value]);
    }
    if (listSize > this.maxHeaderListSize) throw new HeaderListTooLargeError(listSize, this.maxHeaderListSize);
    return headers;
  }
}

// -- encoder ------------------------------------------------------------------------------

export interface EncoderOptions {
  /** The most of the peer's SETTINGS_HEADER_TABLE_SIZE this encoder uses (default 4096). */
  maxTableSize?: number;
  /** Huffman-code strings when not longer (default true). */
  huffman?: boolean;
  /** "all": add every field not sent never-indexed to the dynamic table, as RFC 7541 Appendix C
   * does; "default": leave out values that change with each message and large ones. */
  indexing?: "all" | "default";
}

/** Headers whose values are never put in the dynamic table (6.2.3: secrets, and values that
 * change with every message). */
const NEVER_INDEX = new Set(["authorization", "cookie", "set-cookie", "proxy-authorization"]);
const NO_INDEX = new Set(["grpc-message", "content-length", "date", "grpc-timeout", ":path"]);

export class HpackEncoder {
  readonly table: DynamicTable;
  private readonly cap: number;
  readonly huffman: boolean;
  private readonly indexAll: boolean;
  /** Size updates to announce at the start of the next block (4.2): the smallest, then the last. */
  private pendingSizes: number[] = [];

  constructor(opts: EncoderOptions = {}) {
    this.cap = opts.maxTableSize ?? 4096;
    this.huffman = opts.huffman ?? true;
    this.indexAll = opts.indexing === "all";
    this.table = new DynamicTable(Math.min(4096, this.cap));
  }

  /** The peer announced SETTINGS_HEADER_TABLE_SIZE `size`. */
  setPeerTableSize(size: number): void {
    const use = Math.min(size, this.cap);
    if (use === this.table.maxSize && this.pendingSizes.length === 0) return;
    const smallest = Math.min(use, ...this.pendingSizes);
    this.pendingSizes = smallest < use ? [smallest, use] : [use];
    this.table.resize(smallest);
    this.table.resize(use);
  }

  private find(name: string, value: string): { pair: number; name: number } {
    const pair = STATIC_PAIR.get(`${name}\0${value}`);
    if (pair !== undefined) return { pair, name: pair };
    let nameIndex = STATIC_NAME.get(name) ?? 0;
    for (let i = 0; i < this.table.length; i++) {
      const e = this.table.at(i)!;
      if (e.name !== name) continue;
      if (e.value === value) return { pair: STATIC_TABLE.length + 1 + i, name: nameIndex };
      if (nameIndex === 0) nameIndex = STATIC_TABLE.length + 1 + i;
    }
    return { pair: 0, name: nameIndex };
  }

  /** Encode one header block. `sensitive` names are sent never-indexed. */
  encode(headers: readonly Header[], sensitive?: ReadonlySet<string>): Uint8Array {
    const w = new Writer();
    for (const size of this.pendingSizes) w.integer(size, 5, 0x20);
    this.pendingSizes = [];
    for (const [name, value] of headers) {
      const never = (!this.indexAll && NEVER_INDEX.has(name)) || (sensitive?.has(name) ?? false);
      const found = this.find(name, value);
      if (found.pair && !never) {
        w.integer(found.pair, 7, 0x80);
        continue;
      }
      const valueBytes = utf8.encode(value);
      const nameBytes = found.name ? undefined : utf8.encode(name);
      const octets = (nameBytes?.length ?? utf8.encode(name).length) + valueBytes.length;
      const index =
        !never && (this.indexAll || (!NO_INDEX.has(name) && octets + ENTRY_OVERHEAD <= this.table.maxSize / 2));
      if (index) w.integer(found.name, 6, 0x40);
      else w.integer(found.name, 4, never ? 0x10 : 0);
      if (nameBytes) w.string(nameBytes, this.huffman);
      w.string(valueBytes, this.huffman);
      if (index) this.table.add(name, value, octets);
    }
    return w.result();
  }
}
