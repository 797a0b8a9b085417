// The WebGPU kernel (src/webgpu/) where there is no WebGPU: Node has no navigator.gpu, so
// WebGpuKernel.create() says so (a page then computes with the WASM kernel). Its computations run
// in headless Chromium with WebGPU: tests/test_webgpu_kernel.py (test/webgpu_page.ts).
import assert from "node:assert/strict";
import { test } from "node:test";

import { WebGpuKernel, WebGpuUnavailableError, matvecWgsl } from "../src/webgpu/kernel.js";

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
