// The WebGPU kernel (src/webgpu/) where there is no WebGPU: Node has no navigator.gpu, so
// WebGpuKernel.create() says so (a page then computes with the WASM kernel). Its computations run
// in headless Chromium with WebGPU: tests/test_webgpu_kernel.py (test/webgpu_page.ts).
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  SMALL_ROWS,
  WebGpuKernel,
  WebGpuUnavailableError,
  matvecSmallWgsl,
  matvecWgsl,
  smallLoad,
} from "../src/webgpu/kernel.js";

test("no navigator.gpu, no adapter, no device: WebGpuUnavailableError, saying which", async () => {
  await assert.rejects(WebGpuKernel.create(), (e: unknown) =>
    e instanceof WebGpuUnavailableError && /no navigator\.gpu/.test(e.message));
  await assert.rejects(WebGpuKernel.create({ requestAdapter: async () => null }), (e: unknown) =>
    e instanceof WebGpuUnavailableError && /gave no adapter/.test(e.message));
  const limits = {
    maxStorageBufferBindingSize: 1 << 27, maxBufferSize: 1 << 28, maxComputeWorkgroupsPerDimension: 65535,
    maxComputeInvocationsPerWorkgroup: 256, maxComputeWorkgroupStorageSize: 16384,
  };
  const adapter = {
    limits,
    info: { vendor: "acme", architecture: "test" },
    requestDevice: async () => {
      throw new Error("device limit exceeded");
    },
  };
  await assert.rejects(WebGpuKernel.create({ requestAdapter: async () => adapter }), (e: unknown) =>
    e instanceof WebGpuUnavailableError && /acme \/ test\) gave no device: device limit exceeded/.test(e.message));
});

test("the shader: float32 weights, and bfloat16 ones two to a word", () => {
  assert.match(matvecWgsl(false), /var<storage, read> W: array<f32>/);
  assert.match(matvecWgsl(true), /var<storage, read> W: array<u32>/);
  assert.match(matvecWgsl(true), /bitcast<f32>/);
});

test("the small-batch shader: a load by K, 64 invocations, every row's accumulator, a 2-D grid", () => {
  assert.equal(smallLoad(false, 72), "f32x4");
  assert.equal(smallLoad(false, 131), "f32");
  assert.equal(smallLoad(true, 40), "bf16x8");
  assert.equal(smallLoad(true, 76), "bf16x2");
  assert.equal(smallLoad(true, 33), "bf16x2");
  const types = { f32: ["f32", "f32"], f32x4: ["vec4<f32>", "vec4<f32>"], bf16x2: ["u32", "f32"], bf16x8: ["vec4<u32>", "vec4<f32>"] };
  for (const [load, [w, x]] of Object.entries(types)) {
    const code = matvecSmallWgsl(load as keyof typeof types);
    assert.ok(code.includes(`var<storage, read> W: array<${w}>`), load);
    assert.ok(code.includes(`var<storage, read> X: array<${x}>`), load);
    assert.match(code, /@workgroup_size\(64, 1, 1\)/);
    assert.match(code, /wg\.y \* ng\.x/);
    assert.ok(code.includes(`var a${SMALL_ROWS - 1}: f32`) && !code.includes(`var a${SMALL_ROWS}:`), load);
    if (load.startsWith("bf16")) assert.match(code, /bitcast<(vec4<)?f32>?>/);
  }
  assert.match(matvecSmallWgsl("f32", 4), /const L: u32 = 16u;/);
  assert.throws(() => matvecSmallWgsl("f32", 3), /do not divide/);
});
