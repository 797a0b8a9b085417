// The WASM-SIMD expert kernel (src/wasm/) against the JS kernel of src/worker/expert.ts and the
// vectors of tests/vectors/expert_compute.json; and kernel.wasm against its source.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { fromBinary, toBinary } from "@bufbuild/protobuf";
import asc from "assemblyscript/asc";

import { DispatchRequestSchema } from "../src/gen/kvasir/v1/expert_pb.js";
import { ExpertFunctionSchema } from "../src/gen/kvasir/v1/function_pb.js";
import { TensorSchema } from "../src/gen/kvasir/v1/tensor_pb.js";
import { fromHex, toHex } from "../src/worker/bytes.js";
import {
  decodeTensor,
  encodeTensor,
  floatValues,
  rounder,
  type FloatDType,
} from "../src/worker/dtype.js";
import {
  ACTIVATION_NAMES,
  defaultFunction,
  jsExpertForward,
  matricesFromStored,
  useExpertKernel,
  type ExpertFunction,
  type ExpertMatrices,
  type ExpertResult,
} from "../src/worker/expert.js";
import { functionFromProto } from "../src/worker/function.js";
import { closeUlps, kernelTolerance, vectorValues, worst } from "./kernel_bounds.js";
import { computeDispatch, ServedExperts } from "../src/worker/service.js";
import { WASM_ACTIVATIONS, WasmKernel, WasmMemoryError, wasmExpertForward } from "../src/wasm/kernel.js";
import { prng, randomValues } from "../src/worker/seeded.js";

const ROOT = join(import.meta.dirname, "..");
const WASM = join(ROOT, "src", "wasm", "kernel.wasm");
const VECTORS = join(ROOT, "..", "..", "tests", "vectors");

// eslint-disable-next-line @typescript-eslint/no-explicit-any
type Json = any;

const kernel = WasmKernel.load(readFileSync(WASM));

// -- kernel.wasm is what its source builds -----------------------------------------------------

test("kernel.wasm is what `npm run build:wasm` builds from kernel.as.ts (rebuild it when this fails)", async () => {
  const script: string = JSON.parse(readFileSync(join(ROOT, "package.json"), "utf8")).scripts["build:wasm"];
  const argv = script.split(/\s+/);
  assert.equal(argv.shift(), "asc", "build:wasm runs asc");
  const o = argv.indexOf("-o");
  assert.ok(o >= 0 && argv[o + 1] === "src/wasm/kernel.wasm", "build:wasm writes src/wasm/kernel.wasm");
  const written = new Map<string, Uint8Array>();
  const { error, stderr } = await asc.main(["--baseDir", ROOT, ...argv], {
    writeFile: (name, contents) => {
      written.set(name, typeof contents === "string" ? new TextEncoder().encode(contents) : contents);
    },
  });
  assert.equal(error, null, `asc: ${error} ${stderr.toString()}`);
  const built = [...written].find(([name]) => name.endsWith("kernel.wasm"))?.[1];
  assert.ok(built, `asc wrote ${[...written.keys()].join(", ")}`);
  assert.ok(
    Buffer.from(built).equals(readFileSync(WASM)),
    "src/wasm/kernel.wasm is stale: run `npm run build:wasm` in clients/ts and commit the result",
  );
});

// -- random experts --------------------------------------------------------------------------



interface Case {
  name: string;
  fn: ExpertFunction;
  dtype: FloatDType; // the compute dtype (the weights', the rows')
  weightsDType: FloatDType; // the routing weights'
  /** Scale of the rows: 3 takes gate values past a limit of 7 now and then. */
  xScale: number;
}

const GPT_OSS: ExpertFunction = {
  gate: "clamped_swiglu", activation: "", alpha: 1.702, limit: 7, interleaved: true, transposed: true, bias: true,
};
const MINIMAX: ExpertFunction = { ...GPT_OSS, interleaved: false, transposed: false, bias: false };
const DEEPSEEK_V4: ExpertFunction = { ...defaultFunction("silu"), gate: "clamped_glu", limit: 7 };
const GLU_BIASES: ExpertFunction = { ...defaultFunction("silu"), transposed: true, bias: true };

const kase = (name: string, fn: ExpertFunction, dtype: FloatDType, weightsDType: FloatDType, xScale: number): Case => ({
  name, fn, dtype, weightsDType, xScale,
});

const CASES: Case[] = [
  ...ACTIVATION_NAMES.map((act) =>
    kase(`GLU with ${act}, float32`, defaultFunction(act), "float32", "float32", 2),
  ),
  kase("GLU with silu, bfloat16", defaultFunction("silu"), "bfloat16", "bfloat16", 2),
  kase("GLU with gelu, float16, float32 routing weights", defaultFunction("gelu"), "float16", "float32", 2),
  kase("GLU with silu, transposed, biases, float32", GLU_BIASES, "float32", "float32", 2),
  kase("DeepSeek-V4: clamped GLU with silu, float32", DEEPSEEK_V4, "float32", "float32", 3),
  kase("DeepSeek-V4: clamped GLU with silu, bfloat16", DEEPSEEK_V4, "bfloat16", "bfloat16", 3),
  kase("gpt-oss: clamped SwiGLU, interleaved, transposed, biases, float32", GPT_OSS, "float32", "float32", 3),
  kase("gpt-oss: clamped SwiGLU, interleaved, transposed, biases, bfloat16", GPT_OSS, "bfloat16", "bfloat16", 3),
  kase("gpt-oss: clamped SwiGLU, float16, bfloat16 routing weights", GPT_OSS, "float16", "bfloat16", 3),
  kase("MiniMax-M3: clamped SwiGLU, concatenated, float32", MINIMAX, "float32", "float32", 3),
];

/** [H, I]: odd widths (not multiples of 4 or 8) and one of multiples of 8. */
const SHAPES: [number, number][] = [[37, 11], [13, 5], [64, 24]];
const ROWS = [1, 3, 17, 128];

interface Expert {
  m: ExpertMatrices;
  rows: Float32Array;
  weights: Float32Array;
}

function randomExpert(c: Case, H: number, I: number, n: number, seed: number): Expert {
  const rand = prng(seed);
  // Weights of a realistic scale (|G x| of order xScale); stored as the function's layout says.
  const gateUp = randomValues(rand, 2 * I * H, Math.sqrt(3 / H), c.dtype);
  const down = randomValues(rand, H * I, Math.sqrt(3 / I), c.dtype);
  const biases = c.fn.bias
    ? { gateUp: randomValues(rand, 2 * I, 0.5, c.dtype), down: randomValues(rand, H, 0.5, c.dtype) }
    : undefined;
  const m = matricesFromStored(c.fn, H, I, gateUp, down, biases);
  return { m, rows: randomValues(rand, n * H, c.xScale, c.dtype), weights: randomValues(rand, n, 1, c.weightsDType) };
}

// -- the tolerance ---------------------------------------------------------------------------

/**
 * The most |WASM - JS| of each projection and each output element (test/kernel_bounds.ts): a
 * sum over K (padded to K8) in the WASM kernel goes through at most K8/8 + 4 float32 roundings
 * per term (the product, the pair, K8/8 accumulations, two in the lanes' sum), so K8/8 + 5 with
 * the float64 sum's error.
 */
function tolerance(c: Case, e: Expert, js: ExpertResult): { proj: Float64Array; out: Float64Array } {
  return kernelTolerance(c.fn, c.dtype, c.weightsDType, e, js, (K) => Math.ceil(K / 8) + 5);
}

test("WASM kernel agrees with the JS kernel: every function, dtype, odd widths, 1, 3, 17, 128 rows", async (t) => {
  const k = await kernel;
  let seed = 1;
  let most = 0;
  for (const c of CASES) {
    for (const [H, I] of SHAPES) {
      for (const n of ROWS) {
        const e = randomExpert(c, H, I, n, seed++);
        const js = jsExpertForward(c.fn, c.dtype, e.m, e.rows, e.weights, c.weightsDType);
        const wasm = k.expertForward(c.fn, c.dtype, e.m, e.rows, e.weights, c.weightsDType);
        const what = `${c.name}, H ${H}, I ${I}, ${n} rows`;
        assert.equal(wasm.outDType, js.outDType, what);
        assert.equal(wasm.out.length, n * H, what);
        assert.equal(wasm.proj.length, n * 2 * I, what);
        const tol = tolerance(c, e, js);
        const p = worst(wasm.proj, js.proj, tol.proj);
        const at = (i: number, kind: "proj" | "out"): string =>
          `${what}: ${kind} ${i}: ${wasm[kind][i]} vs ${js[kind][i]} (bound ${tol[kind][i]})`;
        assert.ok(p.ratio <= 1, at(p.at, "proj"));
        const o = worst(wasm.out, js.out, tol.out);
        assert.ok(o.ratio <= 1, at(o.at, "out"));
        // Every value is one of the dtype's.
        const ro = rounder(js.outDType);
        for (let i = 0; i < wasm.out.length; i++) assert.equal(ro(wasm.out[i]!), wasm.out[i]!, `${what}: output ${i}`);
        const rc = rounder(c.dtype);
        for (let i = 0; i < wasm.proj.length; i++) assert.equal(rc(wasm.proj[i]!), wasm.proj[i]!, `${what}: proj ${i}`);
        most = Math.max(most, p.ratio, o.ratio);
      }
    }
  }
  t.diagnostic(`largest |WASM - JS| / bound: ${most.toFixed(4)}`);
});

test("WASM kernel: a row's result depends neither on the call's other rows nor on the blocks it runs in", async () => {
  const c = CASES.find((x) => x.fn === GPT_OSS && x.dtype === "float32")!;
  const e = randomExpert(c, 37, 11, 17, 99);
  const k = await kernel;
  const all = k.expertForward(c.fn, c.dtype, e.m, e.rows, e.weights, c.weightsDType);
  const small = await WasmKernel.load(readFileSync(WASM), { blockRows: 4 });
  const blocks = small.expertForward(c.fn, c.dtype, e.m, e.rows, e.weights, c.weightsDType);
  assert.deepEqual([...blocks.out], [...all.out]);
  assert.deepEqual([...blocks.proj], [...all.proj]);
  for (const r of [0, 5, 16]) {
    const row = e.rows.subarray(r * 37, r * 37 + 37);
    const one = k.expertForward(c.fn, c.dtype, e.m, row, e.weights.subarray(r, r + 1), c.weightsDType);
    assert.deepEqual([...one.out], [...all.out.subarray(r * 37, r * 37 + 37)], `row ${r}`);
  }
});

test("WASM kernel: experts stay placed while others are placed and called", async () => {
  const k = await WasmKernel.load(readFileSync(WASM));
  const c = CASES[0]!;
  const a = randomExpert(c, 37, 11, 128, 7);
  const b = randomExpert({ ...c, dtype: "bfloat16" }, 64, 24, 3, 8); // bfloat16 weights: stored as 16 bits
  const first = k.expertForward(c.fn, c.dtype, a.m, a.rows, a.weights, "float32");
  const held = k.placedBytes;
  assert.equal(held, 2 * 11 * 40 * 4 + 37 * 16 * 4);
  k.expertForward(c.fn, "bfloat16", b.m, b.rows, b.weights, "bfloat16");
  assert.equal(k.placedBytes, held + 2 * 24 * 64 * 2 + 64 * 24 * 2);
  const again = k.expertForward(c.fn, c.dtype, a.m, a.rows, a.weights, "float32");
  assert.deepEqual([...again.out], [...first.out]);
  assert.equal(k.placedBytes, held + 2 * 24 * 64 * 2 + 64 * 24 * 2, "placed once");
  // No rows: no call, empty results.
  const none = k.expertForward(c.fn, c.dtype, a.m, new Float32Array(0), [], "float32");
  assert.equal(none.out.length, 0);
});

test("WASM kernel: an expert the memory cannot hold is refused with a clear error", async () => {
  const k = await WasmKernel.load(readFileSync(WASM), { maxBytes: 2 * 2 ** 20 });
  const c = CASES[0]!;
  const e = randomExpert(c, 512, 384, 1, 3); // 2.25 MiB of float32 weights
  assert.throws(
    () => k.expertForward(c.fn, c.dtype, e.m, e.rows, e.weights, "float32"),
    (exc: unknown) =>
      exc instanceof WasmMemoryError && /cannot hold expert \[H 512, I 384\] \(2\.3 MiB of weights\)/.test(exc.message),
  );
  // A smaller one still fits.
  const f = randomExpert(c, 64, 24, 3, 4);
  const r = k.expertForward(c.fn, c.dtype, f.m, f.rows, f.weights, "float32");
  assert.equal(r.out.length, 3 * 64);
});

test("WASM kernel computes every activation the JS kernel computes, and refuses what it refuses", async () => {
  assert.deepEqual([...WASM_ACTIVATIONS.keys()].sort(), [...ACTIVATION_NAMES].sort());
  const k = await kernel;
  const e = randomExpert(CASES[0]!, 13, 5, 1, 5);
  assert.throws(() => k.expertForward(defaultFunction("mish"), "float32", e.m, e.rows, e.weights, "float32"), /mish/);
  const short = e.rows.subarray(1);
  const silu = defaultFunction("silu");
  assert.throws(() => k.expertForward(silu, "float32", e.m, short, e.weights, "float32"), /values for 1 rows/);
});

// -- the vectors -------------------------------------------------------------------------------

function vectors(name: string): Json {
  return JSON.parse(readFileSync(join(VECTORS, `${name}.json`), "utf8"));
}



test("expert_compute vectors through the WASM kernel: 'single' and every function (projections exact)", async () => {
  const k = await kernel;
  const v = vectors("expert_compute");
  const s = v.single;
  const [, H] = s.hidden.shape as [number, number];
  const I = s.down.shape[1] as number;
  const fn0 = defaultFunction(s.activation);
  const m0 = matricesFromStored(fn0, H, I, vectorValues(s.gate_up), vectorValues(s.down));
  const r0 = k.expertForward(fn0, "float32", m0, vectorValues(s.hidden), vectorValues(s.routing_weights), "float32");
  const want0 = vectorValues(s.output);
  assert.equal(r0.out.length, want0.length);
  for (let i = 0; i < want0.length; i++) {
    assert.ok(closeUlps(r0.out[i]!, want0[i]!, 2, "float32"), `single ${i}: ${r0.out[i]} vs ${want0[i]}`);
  }
  for (const c of v.functions) {
    const fn = functionFromProto(fromBinary(ExpertFunctionSchema, fromHex(c.function_proto_hex)), "silu");
    const dtype = c.dtype as FloatDType;
    const [n, Hc] = c.hidden.shape as [number, number];
    const Ic = (c.projections.shape[1] as number) / 2;
    const biases = fn.bias ? { gateUp: vectorValues(c.gate_up_bias), down: vectorValues(c.down_bias) } : undefined;
    const m = matricesFromStored(fn, Hc, Ic, vectorValues(c.gate_up), vectorValues(c.down), biases);
    const res = k.expertForward(fn, dtype, m, vectorValues(c.hidden), vectorValues(c.routing_weights), c.routing_weights.dtype);
    // The vectors' inputs make every step before the activation exact, in any summation order.
    const projHex = toHex(encodeTensor(dtype, [n, 2 * Ic], res.proj).data);
    assert.equal(projHex, c.projections.data_hex, `${c.name}: projections`);
    const got = floatValues(decodeTensor(encodeTensor(dtype, [n, Hc], res.out)));
    const want = vectorValues(c.output);
    for (let i = 0; i < want.length; i++) {
      assert.ok(closeUlps(got[i]!, want[i]!, 2, dtype), `${c.name}: element ${i}: ${got[i]} vs ${want[i]}`);
    }
  }
});

test("expert_compute 'dispatch' vectors: Dispatch computed by the WASM kernel (--kernel wasm)", async () => {
  const v = vectors("expert_compute");
  const H = v.model.hidden_size as number;
  const I = v.model.intermediate_size as number;
  const fn = defaultFunction(v.model.hidden_act);
  const weights = new Map<string, ExpertMatrices>();
  for (const [e, w] of Object.entries(v.experts as Record<string, Json>)) {
    weights.set(`0:${e}`, matricesFromStored(fn, H, I, vectorValues(w.gate_up), vectorValues(w.down)));
  }
  const experts = Object.keys(v.experts).map(Number);
  const slices = new Map([[0, experts]]);
  const served = new ServedExperts(weights, fn, v.model.dtype, H, I, "qwen3_moe", slices, new Uint8Array(32));
  const k = await WasmKernel.load(readFileSync(WASM));
  useExpertKernel(wasmExpertForward(k));
  try {
    for (const c of v.dispatch) {
      const resp = await computeDispatch(served, fromBinary(DispatchRequestSchema, fromHex(c.dispatch_request_hex)));
      const p = resp.partials!;
      assert.equal(p.callId, BigInt(c.call_id), c.name);
      const got = decodeTensor(p.partials);
      assert.deepEqual(got.shape, c.partials.shape, c.name);
      const want = vectorValues(c.partials);
      const gv = floatValues(got);
      const dtype = c.partials.dtype as FloatDType;
      for (let i = 0; i < want.length; i++) {
        assert.ok(closeUlps(gv[i]!, want[i]!, 2, dtype), `${c.name}: element ${i}: ${gv[i]} vs ${want[i]}`);
      }
      if (c.projections) {
        assert.equal(toHex(toBinary(TensorSchema, p.projections!)), c.projections_tensor_hex, `${c.name}: projections`);
      }
    }
    assert.ok(k.placedBytes > 0, "the WASM kernel computed them");
  } finally {
    useExpertKernel();
  }
});
