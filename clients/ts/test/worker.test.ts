// The TypeScript worker (src/worker/) against tests/vectors/*.json: no server, no Python.
// The end-to-end check against `kvasir conformance` is tests/test_ts_worker.py.
import assert from "node:assert/strict";
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";

import { DispatchRequestSchema, ExpertSegmentSchema, type DispatchRequest } from "../src/gen/kvasir/v1/expert_pb.js";
import { SessionAcceptSchema, SessionHelloSchema } from "../src/gen/kvasir/v1/session_pb.js";
import { TensorSchema } from "../src/gen/kvasir/v1/tensor_pb.js";
import { ExpertFunctionSchema } from "../src/gen/kvasir/v1/function_pb.js";
import { functionFromConfig, functionFromProto, functionToProto } from "../src/worker/function.js";
import { closeClass, CloseCode, concat, fromHex, LocalProtocolError, ProtocolError, toHex } from "../src/worker/bytes.js";
import { AEAD_AES_256_GCM, AEAD_CHACHA20_POLY1305, deriveTunnelKeys, HeartbeatMonitor, KeyExchange, TunnelCipher } from "../src/worker/channel.js";
import { ExpertIndex, parseExpertSpec } from "../src/worker/checkpoint.js";
import { expertDigest, slicesDigest } from "../src/worker/digest.js";
import {
  decodeTensor,
  encodeTensor,
  floatValues,
  fromBf16Bits,
  fromF16Bits,
  toBf16Bits,
  toF16Bits,
  TensorCodecError,
  type FloatDType,
} from "../src/worker/dtype.js";
import {
  defaultFunction,
  erf,
  expertForward,
  jsExpertForward,
  matricesFromStored,
  useExpertKernel,
  type ExpertFunction,
} from "../src/worker/expert.js";
import { acceptSignedMessage, transcriptHash, verifySignature, Wallet, WorkerHandshake } from "../src/worker/handshake.js";
import { computeDispatch, DispatchError, ExpertServiceCore, loadExperts, ServedExperts } from "../src/worker/service.js";
import { WorkerTunnel } from "../src/worker/tunnel.js";
import { closeUlps, vectorValues } from "./kernel_bounds.js";
import { vectorHandshake, vectors, type Json } from "./vectors.js";


const TORCH: Record<string, string> = { float32: "torch.float32", bfloat16: "torch.bfloat16", float16: "torch.float16" };


// -- tensors -------------------------------------------------------------------------------

test("tensor_codec: valid messages decode to their values; float ones encode to the same bytes", () => {
  const v = vectors("tensor_codec");
  for (const c of v.valid) {
    const msg = fromBinary(TensorSchema, fromHex(c.message_hex));
    const t = decodeTensor(msg);
    assert.deepEqual(t.shape, c.tensor.shape, c.name);
    assert.equal(toHex(t.data), c.tensor.data_hex, c.name);
    const dt = c.tensor.dtype as string;
    if (dt === "float32" || dt === "bfloat16" || dt === "float16") {
      assert.deepEqual([...floatValues(t)], c.tensor.values, c.name);
      const enc = encodeTensor(dt as FloatDType, c.tensor.shape, c.tensor.values);
      assert.equal(toHex(toBinary(TensorSchema, enc)), c.message_hex, c.name);
    }
  }
});

test("tensor_codec: invalid messages are refused", () => {
  for (const c of vectors("tensor_codec").invalid) {
    const msg = fromBinary(TensorSchema, fromHex(c.message_hex));
    assert.throws(() => decodeTensor(msg), TensorCodecError, c.name);
  }
});

test("bfloat16 and float16 round to nearest even", () => {
  assert.equal(toBf16Bits(1.0), 0x3f80);
  assert.equal(toBf16Bits(1 + 2 ** -8), 0x3f80); // a tie: to even
  assert.equal(toBf16Bits(1 + 3 * 2 ** -8), 0x3f82); // a tie: to even (up)
  assert.equal(toBf16Bits(NaN), 0x7fc0);
  assert.equal(fromBf16Bits(0xbf00), -0.5);
  assert.equal(toF16Bits(65504), 0x7bff);
  assert.equal(toF16Bits(65520), 0x7c00); // rounds past the largest finite: infinity
  assert.equal(toF16Bits(2 ** -24), 0x0001);
  assert.equal(toF16Bits(2 ** -25), 0x0000); // a tie: to even (zero)
  assert.equal(toF16Bits(3 * 2 ** -25), 0x0002);
  assert.equal(toF16Bits(1 + 2 ** -11), 0x3c00);
  assert.equal(toF16Bits(-1 - 3 * 2 ** -11), 0xbc02);
  for (let b = 0; b < 0x7c00; b += 7) assert.equal(toF16Bits(fromF16Bits(b)), b);
});

test("erf is accurate to well below float32's resolution", () => {
  // Reference values (float64) of erf.
  const ref: [number, number][] = [
    [0.1, 0.1124629160182849], [0.5, 0.5204998778130465], [1, 0.8427007929497149],
    [2, 0.9953222650189527], [3, 0.9999779095030014], [-1.5, -0.9661051464753108],
  ];
  for (const [x, y] of ref) assert.ok(Math.abs(erf(x) - y) < 1e-14, `erf(${x}) = ${erf(x)}, expected ${y}`);
});

// -- the weights digest ------------------------------------------------------------------------

test("weights_digest: each expert's preimage and digest, and the slices digests", () => {
  const v = vectors("weights_digest");
  const digests: Uint8Array[] = [];
  for (const e of v.experts) {
    const torch = TORCH[e.gate.dtype]!;
    const [I, H] = e.gate.shape as [number, number];
    const gateUp = { torchDType: torch, shape: [2 * I, H], data: concat(fromHex(e.gate.data_hex), fromHex(e.up.data_hex)) };
    const down = { torchDType: torch, shape: e.down.shape as number[], data: fromHex(e.down.data_hex) };
    const d = expertDigest(gateUp, down);
    assert.equal(toHex(d), e.expert_digest_hex, e.name);
    digests.push(d);
  }
  for (const s of v.slices) {
    const pairs: [[number, number], Uint8Array][] = (s.experts as number[]).map((i) => [[v.experts[i].layer, v.experts[i].expert], digests[i]!]);
    assert.equal(toHex(slicesDigest(pairs)), s.weights_digest_hex, s.name);
  }
});

// -- the handshake and the channel ---------------------------------------------------------------

test("handshake: the wallet's address, the hello's exact bytes, the accept's signature and the transcript", () => {
  const h = vectors("handshake");
  assert.equal(new Wallet(fromHex(h.wallet_seed_hex)).address, h.wallet_address);
  assert.equal(toHex(new KeyExchange(fromHex(h.worker_kx_private_hex)).publicKey), h.worker_kx_public_hex);
  const hs = vectorHandshake(h);
  const hello = hs.receiveChallenge(fromHex(h.session_challenge_hex));
  const parsed = fromBinary(SessionHelloSchema, hello);
  assert.equal(toHex(parsed.body), h.hello_body_hex, "HelloBody bytes");
  assert.equal(toHex(parsed.signature), h.signature_hex, "Ed25519 is deterministic");
  assert.equal(toHex(hello), h.session_hello_hex);
  assert.ok(verifySignature(h.wallet_address, fromHex(h.signed_message_hex), parsed.signature));
  assert.equal(toHex(hs.transcript()), h.transcript_hash_hex);
  const accepted = hs.receiveAccept(fromHex(h.session_accept_hex));
  assert.equal(accepted.sessionId, h.session_id);
  assert.equal(accepted.encrypted, true);
  assert.equal(accepted.hubKey, h.hub_key);
  assert.ok(accepted.cipher);
  assert.equal(toHex(acceptSignedMessage(fromHex(h.transcript_hash_hex), h.session_id, true, AEAD_CHACHA20_POLY1305)), h.accept_signed_message_hex);
});

test("handshake: refusals of the worker's side and their close codes", () => {
  const h = vectors("handshake");
  const code = (fn: () => unknown): number => {
    try {
      fn();
    } catch (exc) {
      assert.ok(exc instanceof ProtocolError, String(exc));
      return exc.code;
    }
    assert.fail("not refused");
  };
  // A challenge that does not parse, or with a short nonce: 1002.
  assert.equal(code(() => vectorHandshake(h).receiveChallenge(fromHex("0a7f00"))), 1002);
  const ch = fromHex(h.session_challenge_hex);
  // Another hub key than the pinned one: 4104, a permanent refusal (close_codes.json).
  const pinned = new WorkerHandshake((vectorHandshake(h) as Json).info, { requireEncryption: false, aeads: [], expectedHubKey: "00".repeat(32) });
  assert.equal(code(() => pinned.receiveChallenge(ch)), 4104);
  assert.equal(closeClass(4104), "permanent");
  // An accept with one bit of its signature flipped: 1008.
  const acc = fromBinary(SessionAcceptSchema, fromHex(h.session_accept_hex));
  acc.signature = Uint8Array.from(acc.signature, (b, i) => (i === 0 ? b ^ 1 : b));
  const hs = vectorHandshake(h);
  hs.receiveChallenge(ch);
  assert.equal(code(() => hs.receiveAccept(toBinary(SessionAcceptSchema, acc))), 1008);
  // An accept naming AES-256-GCM to a worker that did not offer it: 1008 (its signature is checked first).
  const hs2 = vectorHandshake(h);
  hs2.receiveChallenge(ch);
  const aes = fromBinary(SessionAcceptSchema, fromHex(h.session_accept_hex));
  aes.aead = AEAD_AES_256_GCM;
  assert.equal(code(() => hs2.receiveAccept(toBinary(SessionAcceptSchema, aes))), 1008);
  // An empty session id: 1002.
  const hs3 = vectorHandshake(h);
  hs3.receiveChallenge(ch);
  const empty = fromBinary(SessionAcceptSchema, fromHex(h.session_accept_hex));
  empty.sessionId = "";
  assert.equal(code(() => hs3.receiveAccept(toBinary(SessionAcceptSchema, empty))), 1002);
});

test("close codes: every code's class, and the ranges, as close_codes.json says", () => {
  const c = vectors("close_codes");
  const named = CloseCode as Record<string, number>;
  for (const entry of c.codes) {
    assert.equal(closeClass(entry.code), entry.class, `${entry.name} ${entry.code}`);
    if (entry.name in named) assert.equal(named[entry.name], entry.code, entry.name);
  }
  // Every code this worker names is in the table, with the same name.
  const table = new Map<string, number>(c.codes.map((e: Json) => [e.name, e.code]));
  for (const [name, value] of Object.entries(named)) assert.equal(table.get(name), value, name);
  for (const entry of c.unassigned) assert.equal(closeClass(entry.code), entry.class, String(entry.code));
  for (const r of c.ranges) {
    for (let code = r.first; code <= r.last; code++) assert.equal(closeClass(code), r.class, String(code));
  }
});

function checkMessages(cipherWorker: TunnelCipher, messages: Json[]): void {
  for (const m of messages) {
    const payload = fromHex(m.payload_hex);
    if (m.from === "hub") {
      const opened = cipherWorker.open(fromHex(m.sealed_hex));
      assert.equal(opened.kind === "ack" ? "heartbeat_ack" : opened.kind, m.kind, `hub message ${m.counter}`);
      if (opened.kind === "data") assert.equal(toHex(opened.data), m.payload_hex);
      if (opened.kind === "control") assert.equal(toHex(Buffer.from(opened.word)), m.payload_hex);
      if (opened.kind === "heartbeat" || opened.kind === "ack") assert.equal(opened.seq, Buffer.from(payload).readBigUInt64BE(0));
    } else {
      let sealed: Uint8Array;
      if (m.kind === "data") sealed = cipherWorker.sealData(payload);
      else if (m.kind === "control") sealed = cipherWorker.sealControl(Buffer.from(payload).toString("utf8"));
      else sealed = cipherWorker.sealHeartbeat(Buffer.from(payload).readBigUInt64BE(0), m.kind === "heartbeat_ack");
      assert.equal(toHex(sealed), m.sealed_hex, `worker message ${m.counter}`);
    }
  }
}

test("channel: the shared secret, both keys, and every sealed message each way (ChaCha20-Poly1305)", () => {
  const c = vectors("channel");
  const shared = new KeyExchange(fromHex(c.worker_kx_private_hex)).sharedSecret(fromHex(c.hub_kx_public_hex));
  assert.equal(toHex(shared), c.shared_secret_hex);
  const keys = deriveTunnelKeys(shared, fromHex(c.transcript_hash_hex), AEAD_CHACHA20_POLY1305);
  assert.equal(toHex(keys[0]), c.hub_to_worker_key_hex);
  assert.equal(toHex(keys[1]), c.worker_to_hub_key_hex);
  checkMessages(TunnelCipher.forWorker(keys, AEAD_CHACHA20_POLY1305), c.messages);
  // The handshake's own cipher is the same one.
  const h = vectors("handshake");
  const hs = vectorHandshake(h);
  hs.receiveChallenge(fromHex(h.session_challenge_hex));
  checkMessages(hs.receiveAccept(fromHex(h.session_accept_hex)).cipher!, c.messages);
});

test("channel: AES-256-GCM (the accept's signed form, the keys, the sealed messages)", () => {
  const c = vectors("channel");
  const a = c.aes_256_gcm;
  assert.equal(toHex(acceptSignedMessage(fromHex(c.transcript_hash_hex), a.session_id, true, AEAD_AES_256_GCM)), a.accept_signed_message_hex);
  const keys = deriveTunnelKeys(fromHex(c.shared_secret_hex), fromHex(c.transcript_hash_hex), AEAD_AES_256_GCM);
  assert.equal(toHex(keys[0]), a.hub_to_worker_key_hex);
  assert.equal(toHex(keys[1]), a.worker_to_hub_key_hex);
  checkMessages(TunnelCipher.forWorker(keys, AEAD_AES_256_GCM), a.messages);
});

test("channel: a flipped bit, a replay, a text message or a short message close 1008", () => {
  const c = vectors("channel");
  const keys: [Uint8Array, Uint8Array] = [fromHex(c.hub_to_worker_key_hex), fromHex(c.worker_to_hub_key_hex)];
  const first = fromHex(c.messages[0].sealed_hex);
  const flipped = Uint8Array.from(first, (b, i) => (i === 3 ? b ^ 0x10 : b));
  for (const bad of [flipped, "open", first.subarray(0, 16)]) {
    const cipher = TunnelCipher.forWorker(keys, AEAD_CHACHA20_POLY1305);
    assert.throws(() => cipher.open(bad), (e: unknown) => e instanceof ProtocolError && e.code === 1008);
  }
  const cipher = TunnelCipher.forWorker(keys, AEAD_CHACHA20_POLY1305);
  cipher.open(first);
  assert.throws(() => cipher.open(first), (e: unknown) => e instanceof ProtocolError && e.code === 1008, "a replay");
  const mon = new HeartbeatMonitor();
  assert.throws(() => mon.receiveAck(0n), (e: unknown) => e instanceof ProtocolError && e.code === 1008, "an ack with none waiting");
  assert.equal(mon.beat(), 0n);
  assert.throws(() => mon.receiveAck(1n), (e: unknown) => e instanceof ProtocolError && e.code === 1008, "another number");
});

// -- tunnel control ------------------------------------------------------------------------------

test("tunnel_control: every worker sequence", () => {
  for (const seq of vectors("tunnel_control").sequences.filter((s: Json) => s.side === "worker")) {
    const t = new WorkerTunnel();
    for (const step of seq.steps) {
      const msg: string | Uint8Array = step.send ?? step.receive;
      const m = (msg as Json).text ?? fromHex((msg as Json).binary_hex);
      if (step.send) {
        const send = (): void => {
          if (typeof m !== "string") t.sendData(m.byteLength);
          else if (m === "eof") t.eof();
          else if (m === "closed") t.closed();
          else throw new Error(`a worker never sends ${m}`);
        };
        if (step.local_error) {
          assert.throws(send, LocalProtocolError, seq.name);
          break;
        }
        send();
        assert.equal(t.state, step.state, seq.name);
      } else if (step.error) {
        assert.throws(() => t.receive(m), (e: unknown) => e instanceof ProtocolError && e.code === step.error.close_code, seq.name);
        break;
      } else {
        const ev = t.receive(m);
        assert.equal(ev.kind, (step.event as string).toLowerCase(), seq.name);
        assert.equal(t.state, step.state, seq.name);
      }
    }
  }
});

// -- what an expert computes -----------------------------------------------------------------------


test("expert_compute 'single': one expert over three rows", async () => {
  const v = vectors("expert_compute");
  const s = v.single;
  const [n, H] = s.hidden.shape as [number, number];
  const I = s.down.shape[1] as number;
  const m = matricesFromStored(defaultFunction(s.activation), H, I, vectorValues(s.gate_up), vectorValues(s.down));
  const res = await expertForward(defaultFunction(s.activation), "float32", m, vectorValues(s.hidden), vectorValues(s.routing_weights), "float32");
  assert.equal(res.out.length, n * H);
  const want = vectorValues(s.output);
  for (let i = 0; i < want.length; i++) assert.ok(closeUlps(res.out[i]!, want[i]!, 2, "float32"), `element ${i}: ${res.out[i]} vs ${want[i]}`);
});

test("expert_compute 'functions': each expert function's announcement, projections (exact) and partials", async () => {
  for (const c of vectors("expert_compute").functions) {
    const f = c.function;
    const fn = functionFromProto(fromBinary(ExpertFunctionSchema, fromHex(c.function_proto_hex)), "silu");
    assert.deepEqual(fn, {
      gate: f.gate === 1 ? "glu" : f.gate === 3 ? "clamped_glu" : "clamped_swiglu", activation: f.activation, alpha: f.alpha, limit: f.limit,
      interleaved: f.interleaved, transposed: f.transposed, bias: f.bias,
    }, c.name);
    assert.equal(toHex(toBinary(ExpertFunctionSchema, functionToProto(fn))), c.function_proto_hex, `${c.name}: the announcement`);
    const dtype = c.dtype as FloatDType;
    const [n, H] = c.hidden.shape as [number, number];
    const I = (c.projections.shape[1] as number) / 2;
    const biases = fn.bias ? { gateUp: vectorValues(c.gate_up_bias), down: vectorValues(c.down_bias) } : undefined;
    const m = matricesFromStored(fn, H, I, vectorValues(c.gate_up), vectorValues(c.down), biases);
    const res = await expertForward(fn, dtype, m, vectorValues(c.hidden), vectorValues(c.routing_weights), c.routing_weights.dtype);
    assert.equal(toHex(encodeTensor(dtype, [n, 2 * I], res.proj).data), c.projections.data_hex, `${c.name}: projections`);
    const got = floatValues(decodeTensor(encodeTensor(dtype, [n, H], res.out)));
    const want = vectorValues(c.output);
    for (let i = 0; i < want.length; i++) assert.ok(closeUlps(got[i]!, want[i]!, 2, dtype), `${c.name}: element ${i}: ${got[i]} vs ${want[i]}`);
  }
});

test("configs give their functions: gpt-oss's, MiniMax-M3's, DeepSeek-V4's, and GLU with hidden_act", () => {
  assert.deepEqual(functionFromConfig({ swiglu_limit: 7.0, swiglu_alpha: 1.702, hidden_act: "silu" }, { transposed: true, bias: true }), {
    gate: "clamped_swiglu", activation: "", alpha: 1.702, limit: 7, interleaved: true, transposed: true, bias: true,
  });
  assert.deepEqual(functionFromConfig({ swiglu_limit: 7.0, swiglu_alpha: 1.702 }, { transposed: false, bias: false }), {
    gate: "clamped_swiglu", activation: "", alpha: 1.702, limit: 7, interleaved: false, transposed: false, bias: false,
  });
  assert.deepEqual(functionFromConfig({ swiglu_limit: 10.0, hidden_act: "silu" }, { transposed: false, bias: false }), {
    gate: "clamped_glu", activation: "silu", alpha: 0, limit: 10, interleaved: false, transposed: false, bias: false,
  });
  assert.deepEqual(functionFromConfig({ hidden_act: "gelu" }, { transposed: false, bias: false }), defaultFunction("gelu"));
});

function vectorExperts(v: Json, fn: ExpertFunction = defaultFunction(v.model.hidden_act)): ServedExperts {
  const H = v.model.hidden_size as number;
  const I = v.model.intermediate_size as number;
  const weights = new Map<string, ReturnType<typeof matricesFromStored>>();
  for (const [e, w] of Object.entries(v.experts as Record<string, Json>)) {
    weights.set(`0:${e}`, matricesFromStored(fn, H, I, vectorValues(w.gate_up), vectorValues(w.down)));
  }
  const experts = Object.keys(v.experts).map(Number);
  return new ServedExperts(weights, fn, v.model.dtype, H, I, "qwen3_moe", new Map([[0, experts]]), new Uint8Array(32));
}

test("expert_compute 'dispatch': partials (within a few ulps) and projections (exact bytes) of each call", async () => {
  const v = vectorExperts(vectors("expert_compute"));
  for (const c of vectors("expert_compute").dispatch) {
    const req = fromBinary(DispatchRequestSchema, fromHex(c.dispatch_request_hex));
    const resp = await computeDispatch(v, req);
    const p = resp.partials!;
    assert.equal(p.callId, BigInt(c.call_id), c.name);
    const got = decodeTensor(p.partials);
    assert.deepEqual(got.shape, c.partials.shape, c.name);
    const want = vectorValues(c.partials);
    const gv = floatValues(got);
    const dtype = c.partials.dtype as FloatDType;
    for (let i = 0; i < want.length; i++) assert.ok(closeUlps(gv[i]!, want[i]!, 2, dtype), `${c.name}: element ${i}: ${gv[i]} vs ${want[i]}`);
    if (c.projections) {
      assert.equal(toHex(toBinary(TensorSchema, p.projections!)), c.projections_tensor_hex, `${c.name}: projections`);
    } else {
      assert.equal(p.projections, undefined, `${c.name}: no projections unless asked`);
    }
  }
});

test("Dispatch with an asynchronous kernel (WebGPU's): each segment awaited; computing, calls, rows and drain follow it", async () => {
  const v = vectorExperts(vectors("expert_compute"));
  const c = vectors("expert_compute").dispatch[0];
  const req = fromBinary(DispatchRequestSchema, fromHex(c.dispatch_request_hex));
  const want = await computeDispatch(v, req); // by the JS kernel
  const core = new ExpertServiceCore(v, { wallet: "0x00", device: "test" });
  // A kernel whose results come later, when the test releases them: jsExpertForward's, deferred.
  const pending: (() => void)[] = [];
  let started = 0;
  useExpertKernel((...args) => {
    started++;
    return new Promise((resolve) => pending.push(() => resolve(jsExpertForward(...args))));
  });
  const settle = async (what: string, done: () => boolean): Promise<void> => {
    for (let i = 0; i < 1000 && !done(); i++) await new Promise((r) => setImmediate(r));
    assert.ok(done(), what);
  };
  try {
    // Two calls on one stream: the second arrives once the worker drains.
    const answers = core.dispatch((async function* () {
      yield req;
      yield req;
    })())[Symbol.asyncIterator]();
    const first = answers.next();
    await settle("the first segment started", () => started === 1);
    assert.equal(core.computing, 1);
    assert.equal(core.calls, 0);
    let drained: boolean | undefined;
    void core.drain(30_000).then((ok) => (drained = ok));
    assert.ok(req.segments.length >= 1);
    for (let segment = 1; segment <= req.segments.length; segment++) {
      await settle(`segment ${segment} started`, () => started === segment && pending.length === 1);
      assert.equal(drained, undefined, "drain waits for the call being computed");
      assert.equal(core.computing, 1);
      pending.shift()!();
    }
    const answer = await first;
    assert.equal(answer.done, false);
    assert.equal(core.computing, 0);
    assert.equal(core.calls, 1);
    assert.equal(core.rows, req.segments.reduce((a, s) => a + s.rows, 0));
    await settle("drain resolved once idle", () => drained === true);
    const got = answer.value!.partials!;
    assert.deepEqual(got.partials, want.partials!.partials, "the partials of the synchronous JS kernel");
    assert.deepEqual(got.projections, want.partials!.projections);
    // Draining: the next call is refused (UNAVAILABLE), and computed by no kernel.
    await assert.rejects(answers.next(), (e: unknown) => e instanceof ConnectError && e.code === Code.Unavailable);
    assert.equal(started, req.segments.length);
  } finally {
    useExpertKernel();
  }
});

test("Dispatch refuses bad calls with the status of PROTOCOL.md 9.3", async () => {
  const v = vectorExperts(vectors("expert_compute"));
  const good = fromBinary(DispatchRequestSchema, fromHex(vectors("expert_compute").dispatch[0].dispatch_request_hex));
  const variant = (change: (r: DispatchRequest) => void): DispatchRequest => {
    const r = fromBinary(DispatchRequestSchema, toBinary(DispatchRequestSchema, good));
    change(r);
    return r;
  };
  const cases: [string, DispatchRequest, Code][] = [
    ["hidden one byte short", variant((r) => (r.hidden!.data = r.hidden!.data.subarray(1))), Code.InvalidArgument],
    ["hidden missing", variant((r) => (r.hidden = undefined)), Code.InvalidArgument],
    ["hidden of width 3", variant((r) => { r.hidden!.shape = [4n, 3n]; r.hidden!.data = r.hidden!.data.subarray(0, 48); }), Code.InvalidArgument],
    ["hidden int32", variant((r) => (r.hidden!.dtype = 4)), Code.InvalidArgument],
    ["weights int32", variant((r) => (r.weights!.dtype = 4)), Code.InvalidArgument],
    ["segments short of the rows", variant((r) => (r.segments[0]!.rows -= 1)), Code.InvalidArgument],
    ["a segment of zero rows", variant((r) => r.segments.push(create(ExpertSegmentSchema, { expert: 1, rows: 0 }))), Code.InvalidArgument],
    ["row_index of the wrong count", variant((r) => (r.rowIndex = [0])), Code.InvalidArgument],
    ["row_index past the end", variant((r) => (r.rowIndex = r.rowIndex.length ? r.rowIndex.map(() => 99) : [0, 1, 2, 99])), Code.InvalidArgument],
    ["NaN in hidden", variant((r) => { const d = new Float32Array(r.hidden!.data.slice().buffer); d[0] = NaN; r.hidden!.data = new Uint8Array(d.buffer); }), Code.InvalidArgument],
    ["Inf in weights", variant((r) => { const d = new Float32Array(r.weights!.data.slice().buffer); d[0] = Infinity; r.weights!.data = new Uint8Array(d.buffer); }), Code.InvalidArgument],
    ["an expert not held", variant((r) => (r.segments[0]!.expert = 7)), Code.FailedPrecondition],
    ["a layer not held", variant((r) => (r.layer = 3)), Code.FailedPrecondition],
  ];
  for (const [name, req, code] of cases) {
    await assert.rejects(computeDispatch(v, req), (e: unknown) => e instanceof DispatchError && e.code === code, name);
  }
  // A call of no assignments is valid: [0, H] partials.
  const empty = variant((r) => {
    r.hidden!.shape = [0n, 4n];
    r.hidden!.data = new Uint8Array(0);
    r.weights!.shape = [0n];
    r.weights!.data = new Uint8Array(0);
    r.segments = [];
    r.rowIndex = [];
  });
  assert.deepEqual(decodeTensor((await computeDispatch(v, empty)).partials!.partials).shape, [0, 4]);
});

// -- the checkpoint ------------------------------------------------------------------------------------

/** Write a safetensors file of `tensors` (float32). */
function writeSafetensors(path: string, tensors: Record<string, { shape: number[]; values: number[] }>): void {
  const header: Record<string, unknown> = {};
  const blobs: Uint8Array[] = [];
  let at = 0;
  for (const [k, t] of Object.entries(tensors)) {
    const data = new Uint8Array(Float32Array.from(t.values).buffer);
    header[k] = { dtype: "F32", shape: t.shape, data_offsets: [at, at + data.byteLength] };
    blobs.push(data);
    at += data.byteLength;
  }
  const json = Buffer.from(JSON.stringify(header));
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(json.length));
  writeFileSync(path, concat(len, json, ...blobs));
}

test("a checkpoint's per-expert and fused forms give the same experts, digest and partials", async () => {
  const dir = mkdtempSync(join(tmpdir(), "kvasir-ts-worker-"));
  try {
    const H = 4;
    const I = 2;
    const E = 2;
    const val = (seed: number, n: number): number[] => Array.from({ length: n }, (_, i) => ((seed * 7 + i * 13) % 17) / 8 - 1);
    const gate = [val(1, I * H), val(2, I * H)];
    const up = [val(3, I * H), val(4, I * H)];
    const down = [val(5, H * I), val(6, H * I)];
    const config = { model_type: "qwen3_moe", hidden_size: H, moe_intermediate_size: I, num_hidden_layers: 2, num_experts: E, hidden_act: "silu" };
    const per = join(dir, "per");
    const fused = join(dir, "fused");
    mkdirSync(per);
    mkdirSync(fused);
    writeFileSync(join(per, "config.json"), JSON.stringify(config));
    // The fused form inside text_config, as multimodal checkpoints put it.
    writeFileSync(join(fused, "config.json"), JSON.stringify({ model_type: "outer", text_config: config }));
    const perTensors: Record<string, { shape: number[]; values: number[] }> = {};
    for (let e = 0; e < E; e++) {
      perTensors[`model.layers.1.mlp.experts.${e}.gate_proj.weight`] = { shape: [I, H], values: gate[e]! };
      perTensors[`model.layers.1.mlp.experts.${e}.up_proj.weight`] = { shape: [I, H], values: up[e]! };
      perTensors[`model.layers.1.mlp.experts.${e}.down_proj.weight`] = { shape: [H, I], values: down[e]! };
    }
    perTensors["model.layers.0.mlp.weight"] = { shape: [1], values: [0] }; // a dense layer
    writeSafetensors(join(per, "model.safetensors"), perTensors);
    writeSafetensors(join(fused, "model.safetensors"), {
      "model.language_model.layers.1.mlp.experts.gate_up_proj": { shape: [E, 2 * I, H], values: [0, 1].flatMap((e) => [...gate[e]!, ...up[e]!]) },
      "model.language_model.layers.1.mlp.experts.down_proj": { shape: [E, H, I], values: down.flat() },
    });
    const a = loadExperts(new ExpertIndex(per), "all", defaultFunction("silu"));
    const b = loadExperts(new ExpertIndex(fused), "all", defaultFunction("silu"));
    assert.deepEqual([...a.slices], [[1, [0, 1]]]);
    assert.deepEqual([...b.slices], [[1, [0, 1]]]);
    assert.equal(toHex(a.weightsDigest), toHex(b.weightsDigest));
    const only = loadExperts(new ExpertIndex(per), "1:1", defaultFunction("silu"));
    assert.deepEqual([...only.slices], [[1, [1]]]);
    const x = Float32Array.from(val(9, H));
    for (const e of [0, 1]) {
      const ra = await expertForward(a.fn, "float32", a.get(1, e)!, x, [0.5], "float32");
      const rb = await expertForward(b.fn, "float32", b.get(1, e)!, x, [0.5], "float32");
      assert.deepEqual([...ra.out], [...rb.out]);
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("expert SPEC parsing", () => {
  assert.deepEqual([...parseExpertSpec("all", 2, 3)], [[0, [0, 1, 2]], [1, [0, 1, 2]]]);
  assert.deepEqual([...parseExpertSpec("1:0-1,0:2", 2, 3)], [[0, [2]], [1, [0, 1]]]);
  assert.deepEqual([...parseExpertSpec("*:1", 2, 3)], [[0, [1]], [1, [1]]]);
  assert.throws(() => parseExpertSpec("0:3", 2, 3));
  assert.throws(() => parseExpertSpec("", 2, 3));
});
