// ExpertService (PROTOCOL.md 9) without a transport: the served experts and how they are read
// and checked, Dispatch with the validation and status codes of 9.3, and the service on the
// sans-IO HTTP/2 and gRPC server of src/h2. No Node API: service.ts adds node:http2 and
// Connect's Node adapter; the browser worker (clients/web) uses this as it is.

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";

import { GrpcError, GrpcServer, Status } from "../h2/grpc.js";
import {
  DescribeRequestSchema,
  DescribeResponseSchema,
  DispatchRequestSchema,
  DispatchResponseSchema,
  ExpertPartialsSchema,
  ExpertService,
  type DescribeResponse,
  type DispatchRequest,
  type DispatchResponse,
} from "../gen/kvasir/v1/expert_pb.js";
import { ExpertSliceSchema } from "../gen/kvasir/v1/session_pb.js";
import {
  CheckpointError,
  COMPUTE_DTYPES,
  parseExpertSpec,
  TORCH_DTYPE_NAMES,
  type ExpertIndexCore,
} from "./checkpoint_core.js";
import type { DigestTensor } from "./digest_core.js";
import {
  decodeTensor,
  dtypeName,
  encodeTensor,
  floatDTypeOf,
  floatValues,
  TensorCodecError,
  wireDType,
  type FloatDType,
  type RawTensor,
} from "./dtype.js";
import {
  expertForward,
  matricesFromStored,
  unsupported,
  type ExpertFunction,
  type ExpertMatrices,
} from "./expert.js";

/** Rows or assignments in one call, at most (9.3). */
export const MAX_ROWS_PER_CALL = 1 << 16;
/** The largest gRPC message taken or sent (9: the backbone's limit). */
export const MAX_MESSAGE_BYTES = 256 << 20;

/** The experts this worker serves, in the kernel's layout, and what it announces about them. */
export class ServedExperts {
  constructor(
    readonly weights: Map<string, ExpertMatrices>,
    readonly fn: ExpertFunction,
    readonly dtype: FloatDType,
    readonly hiddenSize: number,
    readonly intermediateSize: number,
    readonly modelType: string,
    readonly slices: Map<number, number[]>,
    readonly weightsDigest: Uint8Array,
  ) {}

  get(layer: number, expert: number): ExpertMatrices | undefined {
    return this.weights.get(`${layer}:${expert}`);
  }

  get count(): number {
    return this.weights.size;
  }
}

/** Little-endian raw bytes of a stored float tensor as float32 values. */
function storedValues(dtype: string, data: Uint8Array): Float32Array {
  const fd = COMPUTE_DTYPES[dtype];
  if (fd === undefined) {
    throw new CheckpointError(`expert weights of dtype ${dtype}: this worker computes F32, BF16 and F16`);
  }
  const wire = wireDType(fd);
  return floatValues({ dtype: wire, shape: [data.byteLength / (fd === "float32" ? 4 : 2)], data: data.slice() });
}

/** The expert function and dtype the checkpoint of `index` is served with, and the (layer,
 * expert) pairs `spec` names that the checkpoint holds; CheckpointError when it cannot be served. */
export function planExperts(
  index: ExpertIndexCore,
  spec: string,
  fn: ExpertFunction,
): { dtype: FloatDType; wanted: [number, number][] } {
  const info = index.info;
  const why = unsupported(fn);
  if (why) throw new CheckpointError(`${index.dir}: ${why}; refusing to start`);
  const dtype = (["float32", "bfloat16", "float16"] as const).find((d) => d === info.dtype);
  if (dtype === undefined) {
    throw new CheckpointError(
      `${index.dir}: model dtype ${info.dtype}: this worker computes float32, bfloat16 and ` +
        `float16`,
    );
  }
  const wanted: [number, number][] = [];
  for (const [layer, experts] of parseExpertSpec(spec, info.numLayers, info.numExperts)) {
    // Skipped: a dense layer, or an expert the checkpoint lacks.
    for (const e of experts) if (index.has(layer, e)) wanted.push([layer, e]);
  }
  if (wanted.length === 0) throw new CheckpointError(`--experts ${spec} names no expert that ${index.dir} has`);
  return { dtype, wanted };
}

/** One expert read and checked: its matrices in the kernel's layout and what its digest hashes. */
export interface PreparedExpert {
  matrices: ExpertMatrices;
  digest: DigestTensor[];
}

/** Read (layer, e) from `index` and check it against the model's facts (PROTOCOL.md 11, 12). */
export function prepareExpert(
  index: ExpertIndexCore,
  fn: ExpertFunction,
  dtype: FloatDType,
  layer: number,
  e: number,
): PreparedExpert {
  const info = index.info;
  const H = info.hiddenSize;
  const I = info.intermediateSize;
  const raw = index.load(layer, e);
  const where = `layer ${layer} expert ${e}`;
  if (COMPUTE_DTYPES[raw.dtype] !== dtype) {
    throw new CheckpointError(`${where}: weights stored as ${raw.dtype}, the config's dtype is ${info.dtype}`);
  }
  const [guRows, guCols] = raw.gateUpShape;
  const [dRows, dCols] = raw.downShape;
  const okShape = fn.transposed
    ? guRows === H && guCols === 2 * I && dRows === I && dCols === H
    : guRows === 2 * I && guCols === H && dRows === H && dCols === I;
  if (!okShape) {
    throw new CheckpointError(
      `${where}: gate_up [${raw.gateUpShape}] and down [${raw.downShape}] do not fit hidden_size ${H} and ` +
        `intermediate size ${I}`,
    );
  }
  const torch = TORCH_DTYPE_NAMES[raw.dtype]!;
  const parts: DigestTensor[] = [
    { torchDType: torch, shape: raw.gateUpShape, data: raw.gateUp },
    { torchDType: torch, shape: raw.downShape, data: raw.down },
  ];
  let biases: { gateUp: Float32Array; down: Float32Array } | undefined;
  if (fn.bias) {
    if (!raw.gateUpBias || !raw.downBias) {
      throw new CheckpointError(`${where}: the expert function has biases and the checkpoint has none`);
    }
    parts.push(
      { torchDType: torch, shape: [2 * I], data: raw.gateUpBias },
      { torchDType: torch, shape: [H], data: raw.downBias },
    );
    biases = { gateUp: storedValues(raw.dtype, raw.gateUpBias), down: storedValues(raw.dtype, raw.downBias) };
    if (biases.gateUp.length !== 2 * I || biases.down.length !== H) {
      throw new CheckpointError(
        `${where}: biases of ${biases.gateUp.length} and ${biases.down.length} values, expected ${2 * I} and ` +
          `${H}`,
      );
    }
  }
  return {
    matrices: matricesFromStored(fn, H, I, storedValues(raw.dtype, raw.gateUp), storedValues(raw.dtype, raw.down),
      biases),
    digest: parts,
  };
}

/** The served experts from what prepareExpert gave for each (layer, expert), and their digest. */
export function servedExperts(
  index: ExpertIndexCore,
  fn: ExpertFunction,
  dtype: FloatDType,
  weights: Map<string, ExpertMatrices>,
  weightsDigest: Uint8Array,
): ServedExperts {
  const slices = new Map<number, number[]>();
  for (const key of weights.keys()) {
    const [layer, e] = key.split(":").map(Number) as [number, number];
    const list = slices.get(layer) ?? [];
    list.push(e);
    slices.set(layer, list);
  }
  for (const list of slices.values()) list.sort((a, b) => a - b);
  const sorted = new Map([...slices].sort((a, b) => a[0] - b[0]));
  const { hiddenSize, intermediateSize, modelType } = index.info;
  return new ServedExperts(weights, fn, dtype, hiddenSize, intermediateSize, modelType, sorted, weightsDigest);
}

// -- Dispatch ------------------------------------------------------------------------------

/** A call refused with a gRPC status (9.3). */
export class DispatchError extends Error {
  constructor(
    readonly code: Code,
    message: string,
  ) {
    super(message);
  }
}

function invalid(msg: string): DispatchError {
  return new DispatchError(Code.InvalidArgument, msg);
}

function allFinite(v: Float32Array): boolean {
  for (let i = 0; i < v.length; i++) if (!Number.isFinite(v[i]!)) return false;
  return true;
}

/** The answer to one DispatchRequest, or DispatchError (its message not yet naming the call).
 * Asynchronous: a kernel may give its results later (WebGPU's); each segment is awaited in turn. */
export async function computeDispatch(ex: ServedExperts, req: DispatchRequest): Promise<DispatchResponse> {
  const t0 = performance.now();
  let hidden: RawTensor;
  let weights: RawTensor;
  try {
    hidden = decodeTensor(req.hidden, "hidden");
    weights = decodeTensor(req.weights, "weights");
  } catch (exc) {
    if (exc instanceof TensorCodecError) throw invalid(exc.message);
    throw exc;
  }
  const H = ex.hiddenSize;
  if (hidden.shape.length !== 2 || hidden.shape[1] !== H) {
    throw invalid(`hidden must have shape [rows, ${H}], got [${hidden.shape.join(", ")}]`);
  }
  const wire = floatDTypeOf(hidden.dtype);
  if (wire !== ex.dtype && !(ex.dtype === "float32" && (wire === "bfloat16" || wire === "float16"))) {
    const narrow = ex.dtype === "float32" ? " (or bfloat16 / float16 on a narrow wire)" : "";
    throw invalid(`hidden must be ${ex.dtype}${narrow}, got ${dtypeName(hidden.dtype)}`);
  }
  const rows = hidden.shape[0]!;
  const segments = req.segments.map((s) => ({ expert: s.expert, rows: s.rows }));
  const covered = segments.reduce((a, s) => a + s.rows, 0);
  if (Math.max(rows, covered) > MAX_ROWS_PER_CALL) {
    throw invalid(`${Math.max(rows, covered)} rows in one call, at most ${MAX_ROWS_PER_CALL}`);
  }
  const index = req.rowIndex.length ? req.rowIndex : undefined;
  if (index === undefined) {
    if (covered !== rows) throw invalid(`segments cover ${covered} rows, hidden has ${rows}`);
  } else {
    if (index.length !== covered) {
      throw invalid(`row_index has ${index.length} entries, segments cover ${covered} rows`);
    }
    let max = 0;
    for (const r of index) if (r > max) max = r;
    if (covered && max >= rows) throw invalid(`row_index names row ${max}, hidden has ${rows} rows`);
  }
  if (weights.shape.length !== 1 || weights.shape[0] !== covered) {
    throw invalid(`weights must have shape [${covered}], got [${weights.shape.join(", ")}]`);
  }
  const wDType = floatDTypeOf(weights.dtype);
  if (wDType === undefined) throw invalid(`weights must be floating point, got ${dtypeName(weights.dtype)}`);
  if (segments.some((s) => s.rows === 0)) throw invalid("a segment has zero rows");
  const x = floatValues(hidden); // widened to float32: every value of a narrow wire is one
  const w = floatValues(weights);
  if (!allFinite(x) || !allFinite(w)) throw invalid("hidden or weights hold NaN or Inf");
  const missing = segments.filter((s) => !ex.get(req.layer, s.expert)).map((s) => s.expert);
  if (missing.length) {
    throw new DispatchError(
      Code.FailedPrecondition,
      `layer ${req.layer}: this worker does not hold experts [${missing.join(", ")}]`,
    );
  }

  const I = ex.intermediateSize;
  const out = new Float64Array(covered * H);
  const proj = req.projections ? new Float32Array(covered * 2 * I) : undefined;
  let start = 0;
  for (const seg of segments) {
    const m = ex.get(req.layer, seg.expert)!;
    const xs = new Float32Array(seg.rows * H);
    for (let r = 0; r < seg.rows; r++) {
      const src = index === undefined ? start + r : index[start + r]!;
      xs.set(x.subarray(src * H, (src + 1) * H), r * H);
    }
    const res = await expertForward(ex.fn, ex.dtype, m, xs, w.subarray(start, start + seg.rows), wDType);
    out.set(res.out, start * H);
    proj?.set(res.proj, start * 2 * I);
    start += seg.rows;
  }
  const micros = BigInt(Math.round((performance.now() - t0) * 1000));
  return create(DispatchResponseSchema, {
    partials: create(ExpertPartialsSchema, {
      callId: req.callId,
      partials: encodeTensor(wire, [covered, H], out),
      computeMicros: micros,
      ...(proj ? { projections: encodeTensor(wire, [covered, 2 * I], proj) } : {}),
    }),
  });
}

// -- the service ---------------------------------------------------------------------------

export interface WorkerIdentity {
  wallet: string;
  device: string;
}

/** The worker's ExpertService without a transport: Describe, Dispatch, the counters, draining,
 * and the sans-IO gRPC server (src/h2) that serves it; `draining` refuses new calls with UNAVAILABLE. */
export class ExpertServiceCore {
  draining = false;
  /** Calls being computed now. */
  computing = 0;
  calls = 0;
  /** performance.now() when the first call was answered (undefined before). */
  firstAnsweredAt: number | undefined;
  rows = 0;
  /** The same service on the sans-IO server (src/h2): GrpcServer.connect() per tunnel connection. */
  readonly grpc: GrpcServer;
  private idleWaiters: (() => void)[] = [];

  constructor(
    readonly experts: ServedExperts,
    readonly identity: WorkerIdentity,
  ) {
    this.grpc = this.sansIoServer();
  }

  private sansIoServer(): GrpcServer {
    const service = `/${ExpertService.typeName}`;
    const server = new GrpcServer({
      maxReceiveMessageBytes: MAX_MESSAGE_BYTES,
      maxSendMessageBytes: MAX_MESSAGE_BYTES,
    });
    const asGrpcError = (exc: unknown): unknown =>
      exc instanceof ConnectError ? new GrpcError(exc.code, exc.rawMessage) : exc;
    server.unary(`${service}/Describe`, (bytes) => {
      fromBinary(DescribeRequestSchema, bytes); // nothing in it, but it must parse
      return toBinary(DescribeResponseSchema, this.describe());
    });
    const decoded = async function* (requests: AsyncIterable<Uint8Array>): AsyncIterable<DispatchRequest> {
      for await (const bytes of requests) {
        let req: DispatchRequest;
        try {
          req = fromBinary(DispatchRequestSchema, bytes);
        } catch (exc) {
          throw new GrpcError(Status.INVALID_ARGUMENT, `a DispatchRequest that does not parse: ${String(exc)}`);
        }
        yield req;
      }
    };
    const dispatch = (requests: AsyncIterable<Uint8Array>): AsyncIterable<Uint8Array> => {
      const answers = this.dispatch(decoded(requests));
      return (async function* () {
        try {
          for await (const answer of answers) yield toBinary(DispatchResponseSchema, answer);
        } catch (exc) {
          throw asGrpcError(exc);
        }
      })();
    };
    server.stream(`${service}/Dispatch`, dispatch);
    return server;
  }

  describe(): DescribeResponse {
    const e = this.experts;
    return create(DescribeResponseSchema, {
      wallet: this.identity.wallet,
      slices: [...e.slices].map(([layer, experts]) => create(ExpertSliceSchema, { layer, experts })),
      weightsDigest: e.weightsDigest,
      device: this.identity.device,
      modelType: e.modelType,
      hiddenSize: e.hiddenSize,
      dtype: wireDType(e.dtype),
    });
  }

  async *dispatch(requests: AsyncIterable<DispatchRequest>): AsyncIterable<DispatchResponse> {
    for await (const req of requests) {
      if (this.draining) throw new ConnectError("worker is draining for shutdown; send elsewhere", Code.Unavailable);
      this.computing += 1;
      let answer: DispatchResponse;
      try {
        answer = await computeDispatch(this.experts, req);
        this.calls += 1;
        this.firstAnsweredAt ??= performance.now();
        this.rows += req.segments.reduce((a, s) => a + s.rows, 0);
      } catch (exc) {
        if (exc instanceof DispatchError) throw new ConnectError(`call ${req.callId}: ${exc.message}`, exc.code);
        if (exc instanceof RangeError) {
          throw new ConnectError(`call ${req.callId}: out of memory: ${exc.message}`, Code.ResourceExhausted);
        }
        throw new ConnectError(
          `call ${req.callId}: internal error: ` +
            `${exc instanceof Error ? exc.message : String(exc)}`, Code.Internal,
        );
      } finally {
        this.computing -= 1;
        if (this.computing === 0) for (const w of this.idleWaiters.splice(0)) w();
      }
      yield answer;
    }
  }

  /** Stop taking calls; resolve true once none is being computed, false after `timeoutMs`. */
  drain(timeoutMs: number): Promise<boolean> {
    this.draining = true;
    if (this.computing === 0) return Promise.resolve(true);
    return new Promise((resolve) => {
      const timer = setTimeout(() => resolve(false), timeoutMs);
      this.idleWaiters.push(() => {
        clearTimeout(timer);
        resolve(true);
      });
    });
  }
}
