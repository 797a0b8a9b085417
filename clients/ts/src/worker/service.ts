// ExpertService (PROTOCOL.md 9): Describe, and Dispatch with the validation and status codes
// of 9.3, served as gRPC over HTTP/2 by node:http2 and Connect's Node adapter, or (--http2
// sans-io) by the sans-IO HTTP/2 and gRPC server of src/h2, which needs no Node API. The HTTP/2
// connections come from the tunnel (session.ts), never from a listening socket. All but the
// Node transport is service_core.ts's, shared with the browser worker (clients/web).

import { createServer, type Http2Server } from "node:http2";

import type { ServiceImpl } from "@connectrpc/connect";
import { connectNodeAdapter } from "@connectrpc/connect-node";

import { ExpertService } from "../gen/kvasir/v1/expert_pb.js";
import type { ExpertIndex } from "./checkpoint.js";
import { expertDigest, slicesDigest } from "./digest.js";
import type { ExpertFunction, ExpertMatrices } from "./expert.js";
import {
  ExpertServiceCore,
  MAX_MESSAGE_BYTES,
  planExperts,
  prepareExpert,
  servedExperts,
  type ServedExperts,
  type WorkerIdentity,
} from "./service_core.js";

export * from "./service_core.js";

/** Read the experts `spec` names (and the checkpoint holds) and digest them (PROTOCOL.md 11, 12).
 * `fn`: the expert function (checkpoint.ts reads the default from the config). */
export function loadExperts(index: ExpertIndex, spec: string, fn: ExpertFunction): ServedExperts {
  const { dtype, wanted } = planExperts(index, spec, fn);
  const weights = new Map<string, ExpertMatrices>();
  const digests: [[number, number], Uint8Array][] = [];
  for (const [layer, e] of wanted) {
    const p = prepareExpert(index, fn, dtype, layer, e);
    digests.push([[layer, e], expertDigest(...p.digest)]);
    weights.set(`${layer}:${e}`, p.matrices);
  }
  return servedExperts(index, fn, dtype, weights, slicesDigest(digests));
}

/** The worker's ExpertService, served by node:http2 and Connect's Node adapter (`http2`), or by
 * the sans-IO server of ExpertServiceCore (`grpc`). */
export class ExpertServer extends ExpertServiceCore {
  readonly http2: Http2Server;

  constructor(experts: ServedExperts, identity: WorkerIdentity) {
    super(experts, identity);
    const impl: ServiceImpl<typeof ExpertService> = {
      describe: () => this.describe(),
      dispatch: (requests) => this.dispatch(requests),
    };
    const handler = connectNodeAdapter({
      routes: (router) => router.service(ExpertService, impl),
      grpc: true,
      grpcWeb: false,
      connect: false,
      readMaxBytes: MAX_MESSAGE_BYTES,
      writeMaxBytes: MAX_MESSAGE_BYTES,
    });
    // The tunnel's connections are handed in with emit("connection", duplex) (session.ts).
    this.http2 = createServer({ maxSessionMemory: 512 }, handler);
    this.http2.on("sessionError", () => undefined);
  }
}
