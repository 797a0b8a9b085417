// The WebGPU expert kernel's checks, run in a web page with WebGPU (tests/test_webgpu_kernel.py
// bundles this module with esbuild, serves it and calls its exports in headless Chromium over
// the DevTools protocol). No Node API. Each export returns a summary: `failures` (empty when
// every check passed) and figures.

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";

import { DispatchRequestSchema } from "../src/gen/kvasir/v1/expert_pb.js";
import { ExpertFunctionSchema } from "../src/gen/kvasir/v1/function_pb.js";
import { TensorSchema } from "../src/gen/kvasir/v1/tensor_pb.js";
import { fromHex, toHex } from "../src/worker/bytes_core.js";
import { decodeTensor, encodeTensor, floatValues, rounder, type FloatDType } from "../src/worker/dtype.js";
import {
  ACTIVATION_NAMES,
  defaultFunction,
  jsExpertForward,
  matricesFromStored,
  useExpertKernel,
  type ExpertFunction,
  type ExpertMatrices,
} from "../src/worker/expert.js";
import { functionFromProto } from "../src/worker/function.js";
import { computeDispatch, ServedExperts } from "../src/worker/service_core.js";
import {
  WebGpuDeviceLostError,
  WebGpuKernel,
  WebGpuMemoryError,
  webgpuExpertForward,
} from "../src/webgpu/kernel.js";
import { auditBound, closeUlps, kernelTolerance, vectorValues, worst, type ExpertInputs } from "./kernel_bounds.js";
import { prng, randomValues } from "../src/worker/seeded.js";

export { measureKernels } from "../src/webgpu/measure.js";

// eslint-disable-next-line @typescript-eslint/no-explicit-any
type Json = any;

export interface Summary {
  failures: string[];
  [figure: string]: unknown;
}



function randomExpert(fn: ExpertFunction, dtype: FloatDType, H: number, I: number, n: number, xScale: number, seed: number): ExpertInputs {
  const rand = prng(seed);
  const gateUp = randomValues(rand, 2 * I * H, Math.sqrt(3 / H), dtype);
  const down = randomValues(rand, H * I, Math.sqrt(3 / I), dtype);
  const biases = fn.bias
    ? { gateUp: randomValues(rand, 2 * I, 0.5, dtype), down: randomValues(rand, H, 0.5, dtype) }
    : undefined;
  const m = matricesFromStored(fn, H, I, gateUp, down, biases);
  return { m, rows: randomValues(rand, n * H, xScale, dtype), weights: randomValues(rand, n, 1, dtype) };
}

/** One float32 sum of K terms in one invocation: at most K + 1 roundings per term (K - 1
 * additions, the product, and an FMA's or the tiles' order changes none of that). */
const GPU_ROUNDINGS = (K: number): number => K + 2;

/** Every gate and activation the JS kernel computes. */
function functions(bias: boolean): { name: string; fn: ExpertFunction; xScale: number }[] {
  const glu = ACTIVATION_NAMES.map((act) => ({
    name: `GLU with ${act}`,
    fn: { ...defaultFunction(act), bias, transposed: bias },
    xScale: 2,
  }));
  return [
    ...glu,
    { name: "clamped GLU with silu", fn: { ...defaultFunction("silu"), gate: "clamped_glu", limit: 7, bias }, xScale: 3 },
    {
      name: "clamped SwiGLU",
      fn: { gate: "clamped_swiglu", activation: "", alpha: 1.702, limit: 7, interleaved: bias, transposed: bias, bias },
      xScale: 3,
    },
  ];
}

const kernelPromise: { k?: Promise<WebGpuKernel> } = {};
function kernel(): Promise<WebGpuKernel> {
  kernelPromise.k ??= WebGpuKernel.create();
  return kernelPromise.k;
}

/** The adapter the kernel runs on. */
export async function adapter(): Promise<string> {
  return (await kernel()).adapterInfo;
}

/**
 * WebGPU against jsExpertForward: every function, float32 / bfloat16 / float16, biases on and
 * off (bfloat16 weights held as 16 bits), the shapes [H, I] and the row counts given (both
 * shaders, each of the small-batch one's loads: K = 72 and 40 by vec4, 131 and 33 one value or
 * one bfloat16 pair at a time): projections and outputs within the
 * first-order bound (kernel_bounds.ts, for one float32 sum per output), outputs within
 * PROTOCOL.md 11's audit bound, every value one of its dtype's.
 */
export async function agreesWithJs(
  shapes: [number, number][] = [[72, 40], [131, 33]],
  counts: number[] = [1, 5, 8, 9, 64, 300], // up to 8 rows the small-batch shader, from 9 the tiled one
): Promise<Summary> {
  const k = await kernel();
  const failures: string[] = [];
  let seed = 1;
  let cases = 0;
  let most = 0;
  let mostAudit = 0;
  let exact = 0;
  let values = 0;
  const t0 = performance.now();
  for (const dtype of ["float32", "bfloat16", "float16"] as FloatDType[]) {
    for (const bias of [false, true]) {
      for (const { name, fn, xScale } of functions(bias)) {
        for (const [H, I] of shapes) {
          for (const n of counts) {
            const e = randomExpert(fn, dtype, H, I, n, xScale, seed++);
            const what = `${name}${bias ? ", biases" : ""}, ${dtype}, H ${H}, I ${I}, ${n} rows`;
            try {
              const js = jsExpertForward(fn, dtype, e.m, e.rows, e.weights, dtype);
              const gpu = await k.expertForward(fn, dtype, e.m, e.rows, e.weights, dtype);
              cases++;
              if (gpu.outDType !== js.outDType || gpu.out.length !== n * H || gpu.proj.length !== n * 2 * I) {
                failures.push(`${what}: result of ${gpu.outDType} [${gpu.out.length}], [${gpu.proj.length}]`);
                continue;
              }
              const tol = kernelTolerance(fn, dtype, dtype, e, js, GPU_ROUNDINGS);
              const p = worst(gpu.proj, js.proj, tol.proj);
              if (!(p.ratio <= 1)) {
                failures.push(`${what}: proj ${p.at}: ${gpu.proj[p.at]} vs ${js.proj[p.at]} (bound ${tol.proj[p.at]})`);
              }
              const o = worst(gpu.out, js.out, tol.out);
              if (!(o.ratio <= 1)) {
                failures.push(`${what}: out ${o.at}: ${gpu.out[o.at]} vs ${js.out[o.at]} (bound ${tol.out[o.at]})`);
              }
              const audit = auditBound(fn, dtype, e, js.out);
              const a = worst(gpu.out, js.out, audit);
              if (!(a.ratio <= 1)) {
                failures.push(`${what}: out ${a.at}: ${gpu.out[a.at]} vs ${js.out[a.at]} past the audit bound ${audit[a.at]}`);
              }
              const ro = rounder(js.outDType);
              const rc = rounder(dtype);
              if (gpu.out.some((v) => ro(v) !== v)) failures.push(`${what}: an output that is not a ${js.outDType} value`);
              if (gpu.proj.some((v) => rc(v) !== v)) failures.push(`${what}: a projection that is not a ${dtype} value`);
              for (let i = 0; i < js.out.length; i++) if (gpu.out[i] === js.out[i]) exact++;
              values += js.out.length;
              most = Math.max(most, p.ratio, o.ratio);
              mostAudit = Math.max(mostAudit, a.ratio);
            } catch (exc) {
              failures.push(`${what}: ${exc instanceof Error ? exc.stack ?? exc.message : String(exc)}`);
            }
            if (failures.length > 20) return { failures, cases };
          }
        }
      }
    }
  }
  return {
    failures,
    cases,
    largestRatioToTolerance: most,
    largestRatioToAuditBound: mostAudit,
    outputsEqualToJs: exact / values,
    seconds: (performance.now() - t0) / 1000,
  };
}



/**
 * tests/vectors/expert_compute.json (`v`) through the WebGPU kernel: 'single' and every
 * function (projections exact: the vectors' inputs make every step before the activation exact
 * in any summation order; outputs within 2 units in the last place and the audit bound), and
 * the 'dispatch' calls through computeDispatch with the kernel in use (useExpertKernel).
 */
export async function vectors(v: Json): Promise<Summary> {
  const k = await kernel();
  const failures: string[] = [];
  const s = v.single;
  const [, H] = s.hidden.shape as [number, number];
  const I = s.down.shape[1] as number;
  const fn0 = defaultFunction(s.activation);
  const m0 = matricesFromStored(fn0, H, I, vectorValues(s.gate_up), vectorValues(s.down));
  const e0 = { m: m0, rows: vectorValues(s.hidden), weights: vectorValues(s.routing_weights) };
  const r0 = await k.expertForward(fn0, "float32", m0, e0.rows, e0.weights, "float32");
  const want0 = vectorValues(s.output);
  const audit0 = auditBound(fn0, "float32", e0, want0);
  for (let i = 0; i < want0.length; i++) {
    if (!closeUlps(r0.out[i]!, want0[i]!, 2, "float32") || !(Math.abs(r0.out[i]! - want0[i]!) <= audit0[i]!)) {
      failures.push(`single ${i}: ${r0.out[i]} vs ${want0[i]}`);
    }
  }
  let functionsChecked = 0;
  for (const c of v.functions) {
    const fn = functionFromProto(fromBinary(ExpertFunctionSchema, fromHex(c.function_proto_hex)), "silu");
    const dtype = c.dtype as FloatDType;
    const [n, Hc] = c.hidden.shape as [number, number];
    const Ic = (c.projections.shape[1] as number) / 2;
    const biases = fn.bias ? { gateUp: vectorValues(c.gate_up_bias), down: vectorValues(c.down_bias) } : undefined;
    const m = matricesFromStored(fn, Hc, Ic, vectorValues(c.gate_up), vectorValues(c.down), biases);
    const e = { m, rows: vectorValues(c.hidden), weights: vectorValues(c.routing_weights) };
    const res = await k.expertForward(fn, dtype, m, e.rows, e.weights, c.routing_weights.dtype);
    const projHex = toHex(encodeTensor(dtype, [n, 2 * Ic], res.proj).data);
    if (projHex !== c.projections.data_hex) failures.push(`${c.name}: projections differ`);
    const got = floatValues(decodeTensor(encodeTensor(dtype, [n, Hc], res.out)));
    const want = vectorValues(c.output);
    const audit = auditBound(fn, dtype, e, want);
    for (let i = 0; i < want.length; i++) {
      if (!closeUlps(got[i]!, want[i]!, 2, dtype) || !(Math.abs(got[i]! - want[i]!) <= audit[i]!)) {
        failures.push(`${c.name}: element ${i}: ${got[i]} vs ${want[i]} (audit bound ${audit[i]})`);
      }
    }
    functionsChecked++;
  }
  // Dispatch: computeDispatch awaits the kernel's promise for each segment.
  const Hm = v.model.hidden_size as number;
  const Im = v.model.intermediate_size as number;
  const fn = defaultFunction(v.model.hidden_act);
  const weights = new Map<string, ExpertMatrices>();
  for (const [e, w] of Object.entries(v.experts as Record<string, Json>)) {
    weights.set(`0:${e}`, matricesFromStored(fn, Hm, Im, vectorValues(w.gate_up), vectorValues(w.down)));
  }
  const slices = new Map([[0, Object.keys(v.experts).map(Number)]]);
  const served = new ServedExperts(weights, fn, v.model.dtype, Hm, Im, "qwen3_moe", slices, new Uint8Array(32));
  const placedBefore = k.placedBytes;
  useExpertKernel(webgpuExpertForward(k));
  let calls = 0;
  try {
    for (const c of v.dispatch) {
      const resp = await computeDispatch(served, fromBinary(DispatchRequestSchema, fromHex(c.dispatch_request_hex)));
      const p = resp.partials!;
      if (p.callId !== BigInt(c.call_id)) failures.push(`${c.name}: call id ${p.callId}`);
      const got = decodeTensor(p.partials);
      if (got.shape.join() !== (c.partials.shape as number[]).join()) failures.push(`${c.name}: shape ${got.shape}`);
      const want = vectorValues(c.partials);
      const gv = floatValues(got);
      const dtype = c.partials.dtype as FloatDType;
      for (let i = 0; i < want.length; i++) {
        if (!closeUlps(gv[i]!, want[i]!, 2, dtype)) failures.push(`${c.name}: element ${i}: ${gv[i]} vs ${want[i]}`);
      }
      if (c.projections && toHex(toBinary(TensorSchema, p.projections!)) !== c.projections_tensor_hex) {
        failures.push(`${c.name}: projections differ`);
      }
      calls++;
    }
  } finally {
    useExpertKernel();
  }
  if (!(k.placedBytes > placedBefore)) failures.push("the dispatch calls did not place their experts on the GPU");
  return { failures, functionsChecked, dispatchCalls: calls };
}

/**
 * Two experts placed, then calls alternating between them (and concurrent ones, which the kernel
 * runs one after another): each call's results are what the expert alone gives, and equal the
 * first call's bit for bit; each expert is uploaded once.
 */
export async function twoExperts(): Promise<Summary> {
  const k = await WebGpuKernel.create();
  const failures: string[] = [];
  try {
    const fnA = defaultFunction("silu");
    const fnB: ExpertFunction = { gate: "clamped_swiglu", activation: "", alpha: 1.702, limit: 7, interleaved: true, transposed: true, bias: true };
    const a = randomExpert(fnA, "float32", 72, 40, 64, 2, 101);
    const b = randomExpert(fnB, "bfloat16", 131, 33, 5, 3, 102); // held as bfloat16, rows padded to even lengths
    k.place(a.m);
    k.place(b.m);
    const held = k.placedBytes;
    const want = 3 * 72 * 40 * 4 + (2 * 33 * 132 + 131 * 34) * 2;
    if (held !== want) failures.push(`placed ${held} bytes, expected ${want}`);
    const ja = jsExpertForward(fnA, "float32", a.m, a.rows, a.weights, "float32");
    const jb = jsExpertForward(fnB, "bfloat16", b.m, b.rows, b.weights, "bfloat16");
    const first = {
      a: await k.expertForward(fnA, "float32", a.m, a.rows, a.weights, "float32"),
      b: await k.expertForward(fnB, "bfloat16", b.m, b.rows, b.weights, "bfloat16"),
    };
    const check = (what: string, got: { out: Float64Array; proj: Float32Array }, ref: typeof first.a): void => {
      if (got.out.some((v, i) => v !== ref.out[i]) || got.proj.some((v, i) => v !== ref.proj[i])) {
        failures.push(`${what}: differs from the expert's first call`);
      }
    };
    const ta = kernelTolerance(fnA, "float32", "float32", a, ja, GPU_ROUNDINGS);
    const tb = kernelTolerance(fnB, "bfloat16", "bfloat16", b, jb, GPU_ROUNDINGS);
    if (!(worst(first.a.out, ja.out, ta.out).ratio <= 1)) failures.push("expert A: out past the bound");
    if (!(worst(first.b.out, jb.out, tb.out).ratio <= 1)) failures.push("expert B: out past the bound");
    for (let round = 0; round < 4; round++) {
      check(`round ${round}, A`, await k.expertForward(fnA, "float32", a.m, a.rows, a.weights, "float32"), first.a);
      check(`round ${round}, B`, await k.expertForward(fnB, "bfloat16", b.m, b.rows, b.weights, "bfloat16"), first.b);
    }
    // Concurrent calls (a worker serving several connections): queued, each its own result.
    const together = await Promise.all([
      k.expertForward(fnA, "float32", a.m, a.rows, a.weights, "float32"),
      k.expertForward(fnB, "bfloat16", b.m, b.rows, b.weights, "bfloat16"),
      k.expertForward(fnA, "float32", a.m, a.rows, a.weights, "float32"),
    ]);
    check("concurrent A", together[0]!, first.a);
    check("concurrent B", together[1]!, first.b);
    check("concurrent A again", together[2]!, first.a);
    // Each row's sums are its own: row 17 alone (the small-batch shader) as in a call of rows
    // 15 to 19; rows 10 to 29 (the tiled shader) as in the call of 64.
    const r = 17;
    const part = async (from: number, to: number) =>
      k.expertForward(fnA, "float32", a.m, a.rows.subarray(from * 72, to * 72), a.weights.subarray(from, to), "float32");
    const one = await part(r, r + 1);
    const five = await part(15, 20);
    if (one.out.some((v, i) => v !== five.out[(r - 15) * 72 + i])) failures.push("row 17 alone differs from row 17 of rows 15 to 19");
    const twenty = await part(10, 30);
    if (twenty.out.some((v, i) => v !== first.a.out[720 + i])) failures.push("rows 10 to 29 differ from those of the call");
    // More rows than a block: the same results as one block.
    const small = await WebGpuKernel.create(undefined, { blockRows: 7 });
    try {
      check("blocks of 7 rows", await small.expertForward(fnA, "float32", a.m, a.rows, a.weights, "float32"), first.a);
    } finally {
      small.destroy();
    }
    if (k.placedBytes !== held) failures.push(`placed ${k.placedBytes} bytes after the calls, ${held} before`);
    const none = await k.expertForward(fnA, "float32", a.m, new Float32Array(0), new Float32Array(0), "float32");
    if (none.out.length !== 0 || none.proj.length !== 0) failures.push("no rows: a non-empty result");
    // A function the kernel does not compute is refused as the JS kernel refuses it.
    try {
      await k.expertForward(defaultFunction("mish"), "float32", a.m, a.rows, a.weights, "float32");
      failures.push("mish was not refused");
    } catch (exc) {
      if (!String(exc).includes("mish")) failures.push(`mish refused with ${String(exc)}`);
    }
  } finally {
    k.destroy();
  }
  return { failures };
}

/**
 * The small-batch shader's 2-D grid: an expert whose gate_up pass has more outputs (2I = 65 602)
 * than a dimension of workgroups allows (65 535, WebGPU's default limit, the kernel's device's),
 * at 1 and 8 rows (the small-batch shader) and 9 (the tiled one), float32 and bfloat16 weights;
 * and the tiled shader alone (smallRows 0) at 1 row: within the bounds, as agreesWithJs checks.
 */
export async function wideExpert(): Promise<Summary> {
  const k = await kernel();
  const tiledOnly = await WebGpuKernel.create(undefined, { smallRows: 0 });
  const failures: string[] = [];
  const fn = defaultFunction("silu");
  let cases = 0;
  try {
    for (const dtype of ["float32", "bfloat16"] as FloatDType[]) {
      for (const [H, I, n, kk] of [[5, 32801, 1, k], [5, 32801, 8, k], [5, 32801, 9, k], [72, 40, 1, tiledOnly]] as const) {
        const what = `${dtype}, H ${H}, I ${I}, ${n} rows${kk === tiledOnly ? ", tiled shader only" : ""}`;
        const e = randomExpert(fn, dtype, H, I, n, 2, 300 + cases);
        try {
          const js = jsExpertForward(fn, dtype, e.m, e.rows, e.weights, dtype);
          const gpu = await kk.expertForward(fn, dtype, e.m, e.rows, e.weights, dtype);
          const tol = kernelTolerance(fn, dtype, dtype, e, js, GPU_ROUNDINGS);
          const p = worst(gpu.proj, js.proj, tol.proj);
          if (!(p.ratio <= 1)) failures.push(`${what}: proj ${p.at}: ${gpu.proj[p.at]} vs ${js.proj[p.at]} (bound ${tol.proj[p.at]})`);
          const o = worst(gpu.out, js.out, tol.out);
          if (!(o.ratio <= 1)) failures.push(`${what}: out ${o.at}: ${gpu.out[o.at]} vs ${js.out[o.at]} (bound ${tol.out[o.at]})`);
          cases++;
        } catch (exc) {
          failures.push(`${what}: ${exc instanceof Error ? exc.stack ?? exc.message : String(exc)}`);
        }
        k.reset();
      }
    }
  } finally {
    tiledOnly.destroy();
  }
  return { failures, cases };
}

/**
 * The clear errors: an expert larger than the kernel's largest buffer (WebGpuMemoryError, before
 * any upload), and a lost device (WebGpuDeviceLostError on every later call).
 */
export async function errors(): Promise<Summary> {
  const failures: string[] = [];
  const small = await WebGpuKernel.create(undefined, { maxBufferBytes: 64 * 1024 });
  const fn = defaultFunction("silu");
  const big = randomExpert(fn, "float32", 128, 72, 2, 2, 201); // gate_up 72 KiB
  const fits = randomExpert(fn, "float32", 64, 32, 2, 2, 202);
  const messages: Record<string, string> = {};
  try {
    small.place(big.m);
    failures.push("an expert larger than the largest buffer was placed");
  } catch (exc) {
    messages.tooBig = String(exc);
    if (!(exc instanceof WebGpuMemoryError) || !/largest buffer/.test(String(exc))) failures.push(`too big: ${String(exc)}`);
  }
  try {
    await small.expertForward(fn, "float32", big.m, big.rows, big.weights, "float32");
    failures.push("a call of an expert larger than the largest buffer computed");
  } catch (exc) {
    if (!(exc instanceof WebGpuMemoryError)) failures.push(`too big, by a call: ${String(exc)}`);
  }
  if (small.placedBytes !== 0) failures.push(`${small.placedBytes} bytes placed after refusing`);
  // What fits still computes on the same kernel.
  const js = jsExpertForward(fn, "float32", fits.m, fits.rows, fits.weights, "float32");
  const got = await small.expertForward(fn, "float32", fits.m, fits.rows, fits.weights, "float32");
  const tol = kernelTolerance(fn, "float32", "float32", fits, js, GPU_ROUNDINGS);
  if (!(worst(got.out, js.out, tol.out).ratio <= 1)) failures.push("the expert that fits: out past the bound");
  // The device lost: a clear error from every later call, and from place().
  small.destroy();
  for (const attempt of [1, 2]) {
    try {
      await small.expertForward(fn, "float32", fits.m, fits.rows, fits.weights, "float32");
      failures.push(`call ${attempt} after the device was lost computed`);
    } catch (exc) {
      messages.lost = String(exc);
      if (!(exc instanceof WebGpuDeviceLostError) || !/device was lost/.test(String(exc))) {
        failures.push(`after the loss: ${String(exc)}`);
      }
    }
  }
  try {
    small.place(big.m);
    failures.push("place() after the loss did not throw");
  } catch (exc) {
    if (!(exc instanceof WebGpuDeviceLostError)) failures.push(`place() after the loss: ${String(exc)}`);
  }
  // No WebGPU: a clear error.
  try {
    await WebGpuKernel.create({ requestAdapter: async () => null });
    failures.push("no adapter: a kernel");
  } catch (exc) {
    messages.noAdapter = String(exc);
    if (!/no adapter/.test(String(exc))) failures.push(`no adapter: ${String(exc)}`);
  }
  return { failures, messages, maxBufferBytes: small.maxBufferBytes };
}
