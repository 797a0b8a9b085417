// BackboneService on a real `python -m backbone serve` with the tiny test checkpoint:
// ListModels, a streamed greedy Generate twice (the same text both times), and a malformed
// request refused with INVALID_ARGUMENT.
import assert from "node:assert/strict";
import { test } from "node:test";

import type { MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient } from "@connectrpc/connect";

import {
  BackboneService,
  FinishReason,
  GenerateRequestSchema,
  type GenerateSummary,
} from "../src/gen/kvasir/v1/backbone_pb.js";
import { CALL_TIMEOUT_MS, need, transport } from "./env.js";

const backbone = createClient(BackboneService, transport(need("KVASIR_TS_BACKBONE")));
const MAX_TOKENS = 8;

type Request = MessageInitShape<typeof GenerateRequestSchema>;

interface Decoded {
  tokenIds: number[];
  text: string;
  summary: GenerateSummary;
}

/** Stream one Generate to its end: the tokens and text of every message, and the summary,
 * which must come once, on the last message. */
async function generate(request: Request): Promise<Decoded> {
  const tokenIds: number[] = [];
  let text = "";
  let summary: GenerateSummary | undefined;
  for await (const msg of backbone.generate(request, { timeoutMs: CALL_TIMEOUT_MS })) {
    assert.equal(summary, undefined, "a message after the summary");
    tokenIds.push(...msg.tokenIds);
    text += msg.text;
    summary = msg.summary;
  }
  assert.ok(summary, "the stream ended without a summary");
  return { tokenIds, text, summary };
}

test("ListModels names the served model", async () => {
  const { models } = await backbone.listModels({}, { timeoutMs: CALL_TIMEOUT_MS });
  assert.equal(models.length, 1);
  assert.equal(models[0]?.id, need("KVASIR_TS_BACKBONE_MODEL"));
});

test("Generate streams greedy tokens, then a summary, the same on every call", async () => {
  const request: Request = { prompt: "The swarm computes", maxTokens: MAX_TOKENS, ignoreEos: true };
  const first = await generate(request);
  assert.equal(first.tokenIds.length, MAX_TOKENS);
  assert.equal(first.summary.completionTokens, MAX_TOKENS);
  assert.equal(first.summary.finishReason, FinishReason.LENGTH);
  assert.ok(first.summary.promptTokens > 0);
  const again = await generate(request);
  assert.deepEqual(again.tokenIds, first.tokenIds);
  assert.equal(again.text, first.text);
});

test("Generate with a negative temperature is INVALID_ARGUMENT", async () => {
  const request: Request = { prompt: "x", maxTokens: 2, sampling: { temperature: -1 } };
  await assert.rejects(generate(request), (err: unknown) => {
    const e = ConnectError.from(err);
    assert.equal(e.code, Code.InvalidArgument, e.message);
    assert.match(e.rawMessage, /temperature/);
    return true;
  });
});

test("Generate cancelled by its client ends with CANCELED, and the service serves on", async () => {
  const abort = new AbortController();
  const stream = backbone.generate(
    { prompt: "The swarm computes", maxTokens: 256, ignoreEos: true },
    { signal: abort.signal, timeoutMs: CALL_TIMEOUT_MS },
  );
  const messages = stream[Symbol.asyncIterator]();
  const first = await messages.next();
  assert.ok(!first.done && first.value.summary === undefined, "the decode ended before it was cancelled");
  abort.abort();
  await assert.rejects(messages.next(), (err: unknown) => {
    assert.equal(ConnectError.from(err).code, Code.Canceled);
    return true;
  });
  const after = await generate({ prompt: "x", maxTokens: 2, ignoreEos: true });
  assert.equal(after.summary.completionTokens, 2);
});
