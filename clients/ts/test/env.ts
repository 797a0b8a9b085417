// What the tests reach: tests/test_ts_clients.py starts the real Python servers on ports of
// their own and passes their addresses (and what it put there) in KVASIR_TS_* variables.
import { createGrpcTransport } from "@connectrpc/connect-node";
import type { Transport } from "@connectrpc/connect";

/** The variable `name`, or an error that says where it comes from. */
export function need(name: string): string {
  const value = process.env[name];
  if (value === undefined || value === "") {
    throw new Error(
      `${name} is not set: these tests call real Kvasir servers, which ` +
        "tests/test_ts_clients.py starts (run `pytest tests/test_ts_clients.py` from the repository root)",
    );
  }
  return value;
}

/** A gRPC transport (HTTP/2 without TLS) to `address` ("host:port"), as a grpcio server speaks it. */
export function transport(address: string): Transport {
  return createGrpcTransport({ baseUrl: `http://${address}` });
}

/** Every call of these tests gives up after this long: a wait without a deadline is a bug. */
export const CALL_TIMEOUT_MS = 60_000;
