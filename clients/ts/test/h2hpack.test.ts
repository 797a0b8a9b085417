// HPACK (src/h2/hpack.ts) against RFC 7541 Appendix C, and its limits and errors.

import assert from "node:assert/strict";
import { describe, test } from "node:test";

import {
  HeaderListTooLargeError,
  HpackDecoder,
  HpackEncoder,
  HpackError,
  huffmanDecode,
  huffmanEncode,
  type Header,
} from "../src/h2/hpack.js";

const hex = (s: string): Uint8Array => Uint8Array.from(Buffer.from(s.replace(/\s+/g, ""), "hex"));
const toHex = (b: Uint8Array): string => Buffer.from(b).toString("hex");

const REQ1: Header[] = [[":method", "GET"], [":scheme", "http"], [":path", "/"], [":authority", "www.example.com"]];
const REQ2: Header[] = [...REQ1, ["cache-control", "no-cache"]];
const REQ3: Header[] = [
  [":method", "GET"], [":scheme", "https"], [":path", "/index.html"], [":authority", "www.example.com"],
  ["custom-key", "custom-value"],
];
const DATE1 = "Mon, 21 Oct 2013 20:13:21 GMT";
const DATE2 = "Mon, 21 Oct 2013 20:13:22 GMT";
const EXAMPLE = "https://www.example.com";
const COOKIE = "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1";
const RESP1: Header[] = [[":status", "302"], ["cache-control", "private"], ["date", DATE1], ["location", EXAMPLE]];
const RESP2: Header[] = [[":status", "307"], ["cache-control", "private"], ["date", DATE1], ["location", EXAMPLE]];
const RESP3: Header[] = [
  [":status", "200"], ["cache-control", "private"], ["date", DATE2], ["location", EXAMPLE],
  ["content-encoding", "gzip"], ["set-cookie", COOKIE],
];

interface Sequence {
  tableSize: number;
  huffman: boolean;
  blocks: string[];
  headers: Header[][];
  tables: Header[][];
  sizes: number[];
}

const REQ_TABLES: Header[][] = [
  [[":authority", "www.example.com"]],
  [["cache-control", "no-cache"], [":authority", "www.example.com"]],
  [["custom-key", "custom-value"], ["cache-control", "no-cache"], [":authority", "www.example.com"]],
];
const RESP_TABLES: Header[][] = [
  [["location", EXAMPLE], ["date", DATE1], ["cache-control", "private"], [":status", "302"]],
  [[":status", "307"], ["location", EXAMPLE], ["date", DATE1], ["cache-control", "private"]],
  [["set-cookie", COOKIE], ["content-encoding", "gzip"], ["date", DATE2]],
];

// RFC 7541 Appendix C.3 - C.6: three header blocks each, sharing one dynamic table.
const SEQUENCES: Record<string, Sequence> = {
  "C.3 requests without Huffman": {
    tableSize: 4096,
    huffman: false,
    blocks: [
      "828684410f7777772e6578616d706c652e636f6d",
      "828684be58086e6f2d6361636865",
      "828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565",
    ],
    headers: [REQ1, REQ2, REQ3],
    tables: REQ_TABLES,
    sizes: [57, 110, 164],
  },
  "C.4 requests with Huffman": {
    tableSize: 4096,
    huffman: true,
    blocks: [
      "828684418cf1e3c2e5f23a6ba0ab90f4ff",
      "828684be5886a8eb10649cbf",
      "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf",
    ],
    headers: [REQ1, REQ2, REQ3],
    tables: REQ_TABLES,
    sizes: [57, 110, 164],
  },
  "C.5 responses without Huffman, evicting": {
    tableSize: 256,
    huffman: false,
    blocks: [
      `4803333032580770726976617465611d4d6f6e2c203231204f637420323031332032303a31333a323120474d54
       6e1768747470733a2f2f7777772e6578616d706c652e636f6d`,
      "4803333037c1c0bf",
      `88c1611d4d6f6e2c203231204f637420323031332032303a31333a323220474d54c05a04677a69707738666f6f
       3d4153444a4b48514b425a584f5157454f50495541585157454f49553b206d61782d6167653d333630303b2076
       657273696f6e3d31`,
    ],
    headers: [RESP1, RESP2, RESP3],
    tables: RESP_TABLES,
    sizes: [222, 222, 215],
  },
  "C.6 responses with Huffman, evicting": {
    tableSize: 256,
    huffman: true,
    blocks: [
      `488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff6e919d29ad171863c78f
       0b97c8e9ae82ae43d3`,
      "4883640effc1c0bf",
      `88c16196d07abe941054d444a8200595040b8166e084a62d1bffc05a839bd9ab77ad94e7821dd7f2e6c7b335df
       dfcd5b3960d5af27087f3672c1ab270fb5291f9587316065c003ed4ee5b1063d5007`,
    ],
    headers: [RESP1, RESP2, RESP3],
    tables: RESP_TABLES,
    sizes: [222, 222, 215],
  },
};

function tableOf(t: { length: number; at(i: number): { name: string; value: string } | undefined }): Header[] {
  const out: Header[] = [];
  for (let i = 0; i < t.length; i++) out.push([t.at(i)!.name, t.at(i)!.value]);
  return out;
}

describe("RFC 7541 Appendix C", () => {
  test("C.1 integers: 10 and 1337 in a 5-bit prefix (as size updates)", () => {
    const d = new HpackDecoder();
    const dec = new HpackDecoder({ maxTableSize: 4096 });
    dec.decode(hex("3f9a0a")); // 001 11111, 1337 - 31 = 1306 = 0x9a 0x0a
    assert.equal(dec.table.maxSize, 1337);
    dec.decode(hex("2a")); // 001 01010 = 10
    assert.equal(dec.table.maxSize, 10);
    assert.deepEqual(d.decode(hex("82")), [[":method", "GET"]]);
  });

  test("C.2 literal fields", () => {
    const d = new HpackDecoder();
    assert.deepEqual(d.decode(hex("400a637573746f6d2d6b65790d637573746f6d2d686561646572")), [
      ["custom-key", "custom-header"],
    ]);
    assert.equal(d.table.size, 55);
    assert.deepEqual(d.decode(hex("040c2f73616d706c652f70617468")), [[":path", "/sample/path"]]);
    assert.deepEqual(d.decode(hex("100870617373776f726406736563726574")), [["password", "secret"]]);
    assert.equal(d.table.size, 55); // neither of those two was indexed
    const e = new HpackEncoder({ huffman: false });
    const block = e.encode([["password", "secret"]], new Set(["password"]));
    assert.equal(toHex(block), "100870617373776f726406736563726574");
  });

  for (const [name, seq] of Object.entries(SEQUENCES)) {
    test(`${name}: decode`, () => {
      const d = new HpackDecoder({ maxTableSize: seq.tableSize });
      seq.blocks.forEach((b, i) => {
        assert.deepEqual(d.decode(hex(b)), seq.headers[i]);
        assert.deepEqual(tableOf(d.table), seq.tables[i]);
        assert.equal(d.table.size, seq.sizes[i]);
      });
    });

    test(`${name}: encode to the RFC's bytes`, () => {
      const e = new HpackEncoder({ maxTableSize: seq.tableSize, huffman: seq.huffman, indexing: "all" });
      seq.headers.forEach((h, i) => {
        assert.equal(toHex(e.encode(h)), seq.blocks[i]!.replace(/\s+/g, ""));
        assert.equal(e.table.size, seq.sizes[i]);
      });
    });
  }
});

describe("Huffman", () => {
  test("round trip of every byte value", () => {
    const all = Uint8Array.from({ length: 256 * 3 }, (_, i) => (i * 7) & 0xff);
    assert.deepEqual(huffmanDecode(huffmanEncode(all)), all);
    assert.equal(toHex(huffmanEncode(new TextEncoder().encode("www.example.com"))), "f1e3c2e5f23a6ba0ab90f4ff");
  });

  test("padding longer than 7 bits, padding of zeros, and EOS are errors", () => {
    const ok = huffmanEncode(new TextEncoder().encode("a")); // 5 bits + 3 of padding
    assert.deepEqual(huffmanDecode(ok), new TextEncoder().encode("a"));
    assert.throws(() => huffmanDecode(Uint8Array.from([...ok, 0xff])), HpackError); // 11 bits of padding
    assert.throws(() => huffmanDecode(Uint8Array.of(ok[0]! & 0xf8)), HpackError); // zero padding
    assert.throws(() => huffmanDecode(hex("ffffffff")), HpackError); // EOS (30 ones)
  });
});

describe("decoder errors and limits", () => {
  test("malformed blocks throw HpackError", () => {
    const cases = {
      "index 0": "80",
      "index past the tables": "be",
      "truncated integer": "7f",
      "string past the block": "400a6375",
      "integer overflow": "1fffffffffffff",
      "size update over the limit": "3fe11f", // 31 + 4065 = 4096 + ... over 4096
      "size update after a field": "8220",
    } as const;
    for (const [what, block] of Object.entries(cases)) {
      const d = new HpackDecoder({ maxTableSize: 4095 });
      assert.throws(() => d.decode(hex(block)), HpackError, what);
    }
  });

  test("a header list over the limit throws after the table is updated", () => {
    const d = new HpackDecoder({ maxHeaderListSize: 100 });
    const e = new HpackEncoder({ indexing: "all" });
    const big: Header[] = [["x-a", "a".repeat(40)], ["x-b", "b".repeat(40)]];
    const block = e.encode(big);
    assert.throws(() => d.decode(block), (err: unknown) => err instanceof HeaderListTooLargeError && err.size > 100);
    // The dynamic table still follows the encoder's: the next block, using its entries, decodes.
    d.maxHeaderListSize = 1000;
    assert.deepEqual(d.decode(e.encode(big)), big);
  });

  test("the encoder announces a smaller table, and both sides evict in step", () => {
    const e = new HpackEncoder();
    const d = new HpackDecoder();
    const h: Header[] = [["x-one", "1".repeat(100)], ["x-two", "2".repeat(100)]];
    assert.deepEqual(d.decode(e.encode(h)), h);
    e.setPeerTableSize(0);
    e.setPeerTableSize(200);
    const block = e.encode(h);
    assert.equal(block[0], 0x20); // size update to 0 ...
    assert.deepEqual(d.decode(block), h);
    assert.equal(d.table.maxSize, 200); // ... then to 200
    assert.deepEqual(tableOf(d.table), tableOf(e.table));
  });

  test("round trip with non-ASCII values and a never-indexed field", () => {
    const e = new HpackEncoder();
    const d = new HpackDecoder();
    const h: Header[] = [
      ["grpc-message", "café ✓"],
      ["authorization", "Bearer x"],
      ["content-type", "application/grpc"],
    ];
    for (let i = 0; i < 3; i++) assert.deepEqual(d.decode(e.encode(h)), h);
    assert.equal(tableOf(d.table).some(([n]) => n === "authorization"), false);
  });
});
