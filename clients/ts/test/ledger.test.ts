// LedgerService.GetBalance on a real `python -m ledger serve`, into which the Python side
// submitted signed receipts before Node started.
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { test } from "node:test";

import { Code, ConnectError, createClient } from "@connectrpc/connect";

import { LedgerService } from "../src/gen/kvasir/v1/ledger_pb.js";
import { CALL_TIMEOUT_MS, need, transport } from "./env.js";

const ledger = createClient(LedgerService, transport(need("KVASIR_TS_LEDGER")));

test("GetBalance reads what the ledger credited from the receipts", async () => {
  const wallet = need("KVASIR_TS_WALLET");
  const got = await ledger.getBalance({ wallet }, { timeoutMs: CALL_TIMEOUT_MS });
  assert.equal(got.wallet, wallet);
  // uint64 fields are bigints: nano-KVR sums stay exact past 2^53.
  assert.equal(typeof got.pendingNanoKvr, "bigint");
  assert.ok(got.pendingNanoKvr > 0n);
  assert.equal(got.pendingNanoKvr, BigInt(need("KVASIR_TS_WALLET_NANO_KVR")));
  assert.equal(got.pendingKvr, need("KVASIR_TS_WALLET_KVR"));
  assert.equal(got.bytesCredited, BigInt(need("KVASIR_TS_WALLET_BYTES")));
  assert.equal(got.units, need("KVASIR_TS_WALLET_UNITS"));
  assert.equal(got.creditCount, BigInt(need("KVASIR_TS_WALLET_CREDITS")));
});

test("GetBalance of a wallet never credited is zero", async () => {
  const stranger = randomBytes(32).toString("hex");
  const got = await ledger.getBalance({ wallet: stranger }, { timeoutMs: CALL_TIMEOUT_MS });
  assert.equal(got.wallet, stranger);
  assert.equal(got.pendingNanoKvr, 0n);
  assert.equal(got.bytesCredited, 0n);
  assert.equal(got.creditCount, 0n);
});

test("GetBalance of a malformed address is INVALID_ARGUMENT", async () => {
  await assert.rejects(
    ledger.getBalance({ wallet: "not-a-wallet" }, { timeoutMs: CALL_TIMEOUT_MS }),
    (err: unknown) => {
      const e = ConnectError.from(err);
      assert.equal(e.code, Code.InvalidArgument, e.message);
      return true;
    },
  );
});
