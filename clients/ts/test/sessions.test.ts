// SessionService.WatchSessions on a real hub (`python -m relay hub`): the watch is open
// before any worker exists, this test then starts a real worker (`python -m worker`, the
// command line comes from the Python side), sees its session arrive, stops it, sees it go,
// and cancels the watch.
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { openSync, closeSync } from "node:fs";
import { test } from "node:test";

import { Code, ConnectError, createClient } from "@connectrpc/connect";

import {
  SessionEvent_Kind,
  SessionService,
  type SessionEvent,
} from "../src/gen/kvasir/v1/session_pb.js";
import { CALL_TIMEOUT_MS, need, transport } from "./env.js";

const hub = createClient(SessionService, transport(need("KVASIR_TS_HUB")));
const bearer = { authorization: `Bearer ${need("KVASIR_TS_BACKBONE_TOKEN")}` };

/** Start the worker the Python side describes: argv as JSON, its output into a log file. */
function startWorker(): ChildProcess {
  const argv = JSON.parse(need("KVASIR_TS_WORKER_ARGV")) as string[];
  const [program, ...args] = argv;
  assert.ok(program, "KVASIR_TS_WORKER_ARGV is an empty list");
  const log = openSync(need("KVASIR_TS_WORKER_LOG"), "w");
  try {
    return spawn(program, args, { stdio: ["ignore", log, log], cwd: need("KVASIR_TS_REPO") });
  } finally {
    closeSync(log);
  }
}

/** Wait (bounded) for `child` to exit; SIGKILL it past the deadline. */
async function reap(child: ChildProcess, ms: number): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  const timer = setTimeout(() => child.kill("SIGKILL"), ms);
  try {
    await exited;
  } finally {
    clearTimeout(timer);
  }
}

test("WatchSessions sees a worker's session come and go", { timeout: 180_000 }, async () => {
  const wallet = need("KVASIR_TS_WORKER_WALLET");
  const abort = new AbortController();
  const stream = hub.watchSessions({}, { signal: abort.signal, timeoutMs: 150_000, headers: bearer });
  const events = stream[Symbol.asyncIterator]();
  const next = async (): Promise<SessionEvent> => {
    const r = await events.next();
    assert.ok(!r.done, "the hub ended the watch");
    assert.ok(r.value.event, "a WatchSessionsResponse without an event");
    return r.value.event;
  };

  let worker: ChildProcess | undefined;
  try {
    // The initial set: one ADDED per live session (none: no worker runs yet), then SYNCED.
    let first = await next();
    while (first.kind === SessionEvent_Kind.ADDED) first = await next();
    assert.equal(first.kind, SessionEvent_Kind.SYNCED);

    worker = startWorker();
    // A worker that dies before its session arrives fails the test now, not at the deadline.
    const died = new Promise<never>((_, reject) => {
      worker?.once("exit", (code, sig) =>
        reject(new Error(`the worker exited (${code ?? sig}) before its session arrived; see its log`)),
      );
    });
    died.catch(() => undefined); // it exits later on purpose, after this race is over
    let added = await Promise.race([next(), died]);
    while (!(added.kind === SessionEvent_Kind.ADDED && added.session?.wallet === wallet)) {
      added = await Promise.race([next(), died]);
    }
    const session = added.session;
    assert.ok(session);
    assert.ok(session.sessionId.length > 0);
    assert.match(session.target, /^127\.0\.0\.1:\d+$/);
    assert.equal(session.modelType, need("KVASIR_TS_MODEL_TYPE"));
    assert.ok(session.slices.length > 0 && session.slices.every((s) => s.experts.length > 0));
    assert.equal(session.weightsDigest.length, 32);

    worker.kill("SIGTERM");
    let removed = await next();
    while (!(removed.kind === SessionEvent_Kind.REMOVED && removed.session?.sessionId === session.sessionId)) {
      removed = await next();
    }

    // Cancelling our own watch ends the iteration with CANCELED, and nothing hangs.
    abort.abort();
    await assert.rejects(events.next(), (err: unknown) => {
      assert.equal(ConnectError.from(err).code, Code.Canceled);
      return true;
    });
  } finally {
    abort.abort();
    if (worker) {
      worker.kill("SIGTERM");
      await reap(worker, 20_000);
    }
  }
});

test("WatchSessions with a wrong backbone token is UNAUTHENTICATED", async () => {
  const stream = hub.watchSessions(
    {},
    { timeoutMs: CALL_TIMEOUT_MS, headers: { authorization: "Bearer not-the-token" } },
  );
  await assert.rejects(
    (async () => {
      for await (const _ of stream) {
        assert.fail("a watch with a wrong token got an event");
      }
    })(),
    (err: unknown) => {
      const e = ConnectError.from(err);
      assert.equal(e.code, Code.Unauthenticated, e.message);
      assert.match(e.rawMessage, /backbone token/);
      return true;
    },
  );
});
