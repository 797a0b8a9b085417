// Reading a Hugging Face Mixture-of-Experts checkpoint (PROTOCOL.md 11) without I/O: the
// safetensors header, the config's facts, where each expert's tensors are and how its bytes are
// put together. No Node API: checkpoint.ts reads files with node:fs, the browser worker
// (clients/web) fetches byte ranges over HTTP.

import { concat } from "./bytes_core.js";
import type { FloatDType } from "./dtype.js";

export class CheckpointError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "CheckpointError";
  }
}

/** safetensors dtype -> the name PyTorch prints for it (the weights digest hashes it, PROTOCOL.md 12). */
export const TORCH_DTYPE_NAMES: Record<string, string> = {
  F64: "torch.float64",
  F32: "torch.float32",
  F16: "torch.float16",
  BF16: "torch.bfloat16",
  F8_E4M3: "torch.float8_e4m3fn",
  F8_E5M2: "torch.float8_e5m2",
  I64: "torch.int64",
  I32: "torch.int32",
  I16: "torch.int16",
  I8: "torch.int8",
  U8: "torch.uint8",
  BOOL: "torch.bool",
};

const ITEM_SIZES: Record<string, number> = {
  F64: 8, F32: 4, F16: 2, BF16: 2, F8_E4M3: 1, F8_E5M2: 1, I64: 8, I32: 4, I16: 2, I8: 1, U8: 1, BOOL: 1,
};

/** safetensors dtype -> the float dtype the worker computes in, for those it computes. */
export const COMPUTE_DTYPES: Record<string, FloatDType> = { F32: "float32", BF16: "bfloat16", F16: "float16" };

/** The model facts an expert needs (PROTOCOL.md 11). */
export interface ModelInfo {
  modelType: string;
  numLayers: number;
  numExperts: number;
  hiddenSize: number;
  intermediateSize: number;
  hiddenAct: string;
  /** The config's dtype name (`float32` when absent), e.g. `bfloat16`. */
  dtype: string;
  /** The config object the facts come from (`text_config` when present). */
  text: Record<string, unknown>;
}

/** One tensor of a safetensors file: absolute byte span in `file`. */
export interface TensorEntry {
  file: string;
  key: string;
  dtype: string;
  shape: number[];
  start: number;
  end: number;
}

export const HEADER_MAX = 100 << 20;

/** The tensors listed in one safetensors file's header: `n` (its first 8 bytes, little-endian)
 * and the `n` bytes of JSON after them, of a file of `size` bytes. Throws CheckpointError when it
 * does not parse. */
export function parseSafetensorsHeader(
  file: string,
  n: number,
  json: Uint8Array,
  size: number,
): Map<string, TensorEntry> {
  let header: unknown;
  try {
    header = JSON.parse(new TextDecoder().decode(json));
  } catch (exc) {
    throw new CheckpointError(`${file}: safetensors header is not JSON: ${String(exc)}`);
  }
  if (typeof header !== "object" || header === null) throw new CheckpointError(`${file}: header is not an object`);
  const out = new Map<string, TensorEntry>();
  for (const [key, meta] of Object.entries(header as Record<string, unknown>)) {
    if (key === "__metadata__") continue;
    const m = meta as { dtype?: unknown; shape?: unknown; data_offsets?: unknown };
    if (typeof m.dtype !== "string" || !Array.isArray(m.shape) || !Array.isArray(m.data_offsets)) {
      throw new CheckpointError(`${file}: tensor ${key}: malformed header entry`);
    }
    const shape = (m.shape as unknown[]).map(Number);
    const [a, b] = (m.data_offsets as unknown[]).map(Number);
    if (a === undefined || b === undefined || !(a <= b)) {
      throw new CheckpointError(`${file}: tensor ${key}: bad data_offsets`);
    }
    const start = 8 + n + a;
    const end = 8 + n + b;
    const item = ITEM_SIZES[m.dtype];
    const count = shape.reduce((x, y) => x * y, 1);
    if (end > size || (item !== undefined && end - start !== count * item)) {
      throw new CheckpointError(
        `${file}: tensor ${key}: its bytes do not match its dtype and shape (or the file is ` +
          `truncated)`,
      );
    }
    out.set(key, { file, key, dtype: m.dtype, shape, start, end });
  }
  return out;
}

/** The length of a safetensors header from its first 8 bytes; CheckpointError when out of bounds. */
export function safetensorsHeaderLength(file: string, head: Uint8Array): number {
  if (head.byteLength < 8) throw new CheckpointError(`${file}: shorter than a safetensors header`);
  const n = Number(new DataView(head.buffer, head.byteOffset, 8).getBigUint64(0, true));
  if (n <= 0 || n > HEADER_MAX) throw new CheckpointError(`${file}: safetensors header of ${n} bytes`);
  return n;
}

/** The shard files a model.safetensors.index.json names, sorted, once each. */
export function indexedFiles(indexJson: string): string[] {
  const map = (JSON.parse(indexJson) as { weight_map?: Record<string, string> }).weight_map ?? {};
  return [...new Set(Object.values(map))].sort();
}

// Key forms (PROTOCOL.md 11): P is any prefix ending with "layers.".
const PER_EXPERT = new RegExp(
  String.raw`^(?<prefix>.*?)layers\.(?<layer>\d+)\.(?:mlp|block_sparse_moe|ffn)\.experts\.(?<expert>\d+)\.` +
    String.raw`(?<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$`,
);
const FUSED = new RegExp(
  String.raw`^(?<prefix>.*?)layers\.(?<layer>\d+)\.(?:mlp|block_sparse_moe)\.` +
    String.raw`(?:experts\.(?<proj>gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)` +
    String.raw`|(?<old>input_linear|output_linear|experts\.fc1|experts\.fc2)\.weight)$`,
);
// The fused tensors' older names, which transformers' conversion mapping renames on load (11).
const OLD_FUSED: Record<string, FusedName> = {
  input_linear: "gate_up_proj",
  output_linear: "down_proj",
  "experts.fc1": "gate_up_proj",
  "experts.fc2": "down_proj",
};
type FusedName = "gate_up_proj" | "down_proj" | "gate_up_proj_bias" | "down_proj_bias";

function fusedName(groups: Record<string, string | undefined>): FusedName {
  return (groups.proj as FusedName | undefined) ?? OLD_FUSED[groups.old!]!;
}
const PROJ: Record<string, "gate" | "up" | "down"> = {
  gate_proj: "gate", w1: "gate", up_proj: "up", w3: "up", down_proj: "down", w2: "down",
};

function num(v: unknown): number | undefined {
  return typeof v === "number" && Number.isFinite(v) ? v : undefined;
}

/** The facts of PROTOCOL.md 11 from the config object `cfg` read from `path` (and the tensors,
 * where the config names no expert count). */
export function modelInfoFromConfig(
  path: string,
  cfg: Record<string, unknown>,
  tensors: () => Map<string, TensorEntry>,
): ModelInfo {
  if (typeof cfg !== "object" || cfg === null || Array.isArray(cfg)) {
    throw new CheckpointError(`${path} is not a JSON object`);
  }
  const nested = typeof cfg.text_config === "object" && cfg.text_config !== null;
  const text = (nested ? cfg.text_config : cfg) as Record<string, unknown>;
  let numExperts = num(text.num_experts) || num(text.num_local_experts) || 0;
  let inter = num(text.moe_intermediate_size) ?? num(text.intermediate_size);
  if (!numExperts) {
    // Where config.json names neither, the expert tensors say it (PROTOCOL.md 11).
    const seen = experts_in_tensors(tensors());
    numExperts = seen.experts;
    inter = inter ?? seen.inter;
    if (!numExperts) {
      throw new CheckpointError(
        `${path}: not a Mixture-of-Experts checkpoint (no num_experts / num_local_experts, no expert ` +
          `tensors)`,
      );
    }
  }
  if (inter === undefined) throw new CheckpointError(`${path}: no moe_intermediate_size / intermediate_size`);
  const hidden = num(text.hidden_size);
  const layers = num(text.num_hidden_layers);
  if (hidden === undefined || layers === undefined) {
    throw new CheckpointError(`${path}: no hidden_size / num_hidden_layers`);
  }
  const dtypeRaw = text.dtype ?? text.torch_dtype ?? cfg.dtype ?? cfg.torch_dtype ?? "float32";
  return {
    modelType: String(text.model_type ?? cfg.model_type ?? ""),
    numLayers: layers,
    numExperts,
    hiddenSize: hidden,
    intermediateSize: inter,
    hiddenAct: String(text.hidden_act ?? "silu"),
    dtype: String(dtypeRaw).replace(/^torch\./, ""),
    text,
  };
}

function experts_in_tensors(tensors: Map<string, TensorEntry>): { experts: number; inter: number | undefined } {
  let experts = 0;
  let inter: number | undefined;
  for (const [key, t] of tensors) {
    const m = PER_EXPERT.exec(key);
    if (m?.groups) {
      experts = Math.max(experts, Number(m.groups.expert) + 1);
      if (PROJ[m.groups.proj!] === "gate" && t.shape.length === 2) inter = t.shape[0];
      continue;
    }
    const f = FUSED.exec(key);
    if (f?.groups && fusedName(f.groups) === "down_proj" && t.shape.length === 3) {
      // down is [E, H, I], or [E, I, H] transposed: I is the smaller of the two (I < H in every MoE)
      experts = Math.max(experts, t.shape[0]!);
      inter = Math.min(t.shape[1]!, t.shape[2]!);
    }
  }
  return { experts, inter };
}

/** One expert's weights as stored: gate_up [2I, H] (gate rows then up rows) and down [H, I], raw bytes. */
export interface RawExpert {
  dtype: string;
  gateUp: Uint8Array;
  gateUpShape: [number, number];
  down: Uint8Array;
  downShape: [number, number];
  /** Where the experts have biases: gate_up_bias [2I] and down_bias [H], raw bytes of the same dtype. */
  gateUpBias?: Uint8Array;
  downBias?: Uint8Array;
}

interface Loc {
  gate?: TensorEntry;
  up?: TensorEntry;
  down?: TensorEntry;
  gate_up_proj?: TensorEntry;
  down_proj?: TensorEntry;
  gate_up_proj_bias?: TensorEntry;
  down_proj_bias?: TensorEntry;
  index?: number;
}

/** Reads bytes [start, end) of the file a tensor is in. */
export type TensorReader = (t: TensorEntry, start: number, end: number) => Uint8Array;

/** One byte span of a tensor's file. */
export interface TensorSpan {
  tensor: TensorEntry;
  start: number;
  end: number;
}

/** Where each (layer, expert)'s weights are, from the tensors of every safetensors header and the
 * model's facts; `read` gives the bytes of a span (checkpoint.ts: from the file). */
export class ExpertIndexCore {
  private readonly locs = new Map<string, Loc>();

  constructor(
    readonly dir: string,
    tensors: Map<string, TensorEntry>,
    readonly info: ModelInfo,
    private readonly read: TensorReader,
  ) {
    for (const [key, t] of tensors) {
      const m = PER_EXPERT.exec(key);
      if (m?.groups) {
        const loc = this.slot(Number(m.groups.layer), Number(m.groups.expert));
        loc[PROJ[m.groups.proj!]!] = t;
        continue;
      }
      const f = FUSED.exec(key);
      if (f?.groups) {
        const layer = Number(f.groups.layer);
        const name = fusedName(f.groups);
        for (let e = 0; e < this.info.numExperts; e++) {
          const loc = this.slot(layer, e);
          loc[name] = t;
          loc.index = e;
        }
      }
    }
    const complete = (v: Loc): boolean => Boolean((v.gate && v.up && v.down) || (v.gate_up_proj && v.down_proj));
    const incomplete = [...this.locs].filter(([, v]) => !complete(v));
    if (incomplete.length) {
      throw new CheckpointError(
        `${dir}: experts with missing projections: ` +
          `${incomplete.slice(0, 8).map(([k]) => k).join(" ")}`,
      );
    }
    if (this.locs.size === 0) throw new CheckpointError(`${dir}: no expert tensors found in the safetensors files`);
    const biased = [...this.locs.values()].map((v) => Boolean(v.gate_up_proj_bias && v.down_proj_bias));
    if (biased.some((b) => b !== biased[0])) {
      throw new CheckpointError(`${dir}: some experts have biases and some do not`);
    }
    this.hasBias = biased[0]!;
    this.transposed = this.readOrientation();
  }

  /** The experts add biases (fused `_bias` tensors, 11). */
  readonly hasBias: boolean;
  /** The fused tensors are stored [E, H, 2I] and [E, I, H] (11.2); per-expert tensors never are. */
  readonly transposed: boolean;

  /** Which reading of the fused tensors' shapes fits H and I (11.2); CheckpointError when neither does. */
  private readOrientation(): boolean {
    const H = this.info.hiddenSize;
    const I = this.info.intermediateSize;
    const seen = new Set<string>();
    let transposed: boolean | undefined;
    for (const loc of this.locs.values()) {
      const gu = loc.gate_up_proj;
      const dn = loc.down_proj;
      if (!gu || !dn || seen.has(gu.key)) continue;
      seen.add(gu.key);
      const fits = (a: number[], b: number[]): boolean =>
        gu.shape.length === 3 && dn.shape.length === 3 &&
        gu.shape[1] === a[0] && gu.shape[2] === a[1] && dn.shape[1] === b[0] && dn.shape[2] === b[1];
      const t = fits([H, 2 * I], [I, H]) ? true : fits([2 * I, H], [H, I]) ? false : undefined;
      if (t === undefined) {
        throw new CheckpointError(
          `${this.dir}: fused expert tensors of shapes [${gu.shape}] and [${dn.shape}] fit neither ` +
            "[E, 2I, H] / [E, H, I] " +
            `nor [E, H, 2I] / [E, I, H] with hidden_size ${H} and intermediate size ${I}`,
        );
      }
      if (transposed !== undefined && t !== transposed) {
        throw new CheckpointError(`${this.dir}: some fused experts are transposed and some are not`);
      }
      transposed = t;
    }
    return transposed ?? false;
  }

  private slot(layer: number, expert: number): Loc {
    const k = `${layer}:${expert}`;
    let loc = this.locs.get(k);
    if (!loc) {
      loc = {};
      this.locs.set(k, loc);
    }
    return loc;
  }

  has(layer: number, expert: number): boolean {
    return this.locs.has(`${layer}:${expert}`);
  }

  /** Every (layer, expert) present, as layer -> ascending experts, layers ascending. */
  slices(): Map<number, number[]> {
    const pairs = [...this.locs.keys()].map((k) => k.split(":").map(Number) as [number, number]);
    pairs.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
    const out = new Map<number, number[]>();
    for (const [l, e] of pairs) {
      const list = out.get(l) ?? [];
      list.push(e);
      out.set(l, list);
    }
    return out;
  }

  /** The spans of the files that hold one expert's tensors, in the order load() reads them. */
  spans(layer: number, expert: number): TensorSpan[] {
    return this.layout(layer, expert).spans;
  }

  private layout(layer: number, expert: number): { spans: TensorSpan[]; assemble: (b: Uint8Array[]) => RawExpert } {
    const loc = this.locs.get(`${layer}:${expert}`);
    if (!loc) throw new CheckpointError(`layer ${layer} expert ${expert} is not in the checkpoint`);
    const where = `layer ${layer} expert ${expert}`;
    if (loc.gate_up_proj && loc.down_proj && loc.index !== undefined) {
      const e = loc.index;
      const row = (t: TensorEntry): TensorSpan => {
        if (e >= t.shape[0]!) throw new CheckpointError(`${where}: ${t.key} has shape [${t.shape}]`);
        const per = (t.end - t.start) / t.shape[0]!;
        return { tensor: t, start: t.start + e * per, end: t.start + (e + 1) * per };
      };
      const gu = loc.gate_up_proj;
      const dn = loc.down_proj;
      if (gu.shape.length !== 3 || dn.shape.length !== 3) {
        throw new CheckpointError(`${where}: fused tensors of shape [${gu.shape}] and [${dn.shape}]`);
      }
      const parts = [gu, dn, loc.gate_up_proj_bias, loc.down_proj_bias].filter(
        (t): t is TensorEntry => t !== undefined,
      );
      if (parts.some((t) => t.dtype !== gu.dtype)) {
        throw new CheckpointError(`${where}: the expert tensors' dtypes differ (${parts.map((t) => t.dtype)})`);
      }
      const spans = [row(gu), row(dn)];
      if (this.hasBias) spans.push(row(loc.gate_up_proj_bias!), row(loc.down_proj_bias!));
      return {
        spans,
        assemble: (b) => {
          const raw: RawExpert = {
            dtype: gu.dtype,
            gateUp: b[0]!,
            gateUpShape: [gu.shape[1]!, gu.shape[2]!],
            down: b[1]!,
            downShape: [dn.shape[1]!, dn.shape[2]!],
          };
          if (this.hasBias) {
            raw.gateUpBias = b[2]!;
            raw.downBias = b[3]!;
          }
          return raw;
        },
      };
    }
    const { gate, up, down } = loc as Required<Pick<Loc, "gate" | "up" | "down">>;
    for (const t of [gate, up, down]) {
      if (t.shape.length !== 2) throw new CheckpointError(`${where}: ${t.key} has shape [${t.shape}], not 2-D`);
    }
    if (gate.dtype !== up.dtype || gate.dtype !== down.dtype) {
      throw new CheckpointError(`${where}: gate ${gate.dtype}, up ${up.dtype} and down ${down.dtype} differ`);
    }
    if (gate.shape[1] !== up.shape[1]) {
      throw new CheckpointError(`${where}: gate [${gate.shape}] and up [${up.shape}] differ in width`);
    }
    const whole = (t: TensorEntry): TensorSpan => ({ tensor: t, start: t.start, end: t.end });
    return {
      spans: [whole(gate), whole(up), whole(down)],
      assemble: (b) => ({
        dtype: gate.dtype,
        gateUp: concat(b[0]!, b[1]!),
        gateUpShape: [gate.shape[0]! + up.shape[0]!, gate.shape[1]!],
        down: b[2]!,
        downShape: [down.shape[0]!, down.shape[1]!],
      }),
    };
  }

  /** Read one expert's bytes: gate_up [2I, H] and down [H, I] exactly as stored (PROTOCOL.md 11, 12). */
  load(layer: number, expert: number): RawExpert {
    const { spans, assemble } = this.layout(layer, expert);
    return assemble(spans.map((s) => this.read(s.tensor, s.start, s.end)));
  }
}

/** Parse an expert SPEC (the Python worker's syntax): comma-separated items, each `all` or
 * `LAYERS:EXPERTS`, each side `N`, `N-M` (inclusive) or `*`. Returns layer -> sorted experts. */
export function parseExpertSpec(spec: string, numLayers: number, numExperts: number): Map<number, number[]> {
  const out = new Map<number, Set<number>>();
  const range = (text: string, limit: number, what: string): number[] => {
    const t = text.trim();
    if (t === "*") return Array.from({ length: limit }, (_, i) => i);
    const m = /^([0-9]{1,9})(?:-([0-9]{1,9}))?$/.exec(t);
    if (!m) throw new CheckpointError(`${what} ${JSON.stringify(t)}: expected N, N-M or *`);
    const lo = Number(m[1]);
    const hi = m[2] !== undefined ? Number(m[2]) : lo;
    if (lo > hi) throw new CheckpointError(`${what} range ${JSON.stringify(t)} is empty`);
    if (hi >= limit) {
      throw new CheckpointError(`${what} ${hi} out of range: the model has ${limit} (${what}s 0-${limit - 1})`);
    }
    return Array.from({ length: hi - lo + 1 }, (_, i) => lo + i);
  };
  const items = spec.split(",").map((s) => s.trim()).filter((s) => s);
  if (!items.length) throw new CheckpointError("empty expert SPEC; use e.g. 'all', '*:0-7' or '0-3:0-15'");
  for (const item of items) {
    let layers: number[];
    let experts: number[];
    if (item === "all") {
      layers = range("*", numLayers, "layer");
      experts = range("*", numExperts, "expert");
    } else {
      const parts = item.split(":");
      if (parts.length !== 2) {
        throw new CheckpointError(`SPEC item ${JSON.stringify(item)}: expected LAYERS:EXPERTS or 'all'`);
      }
      layers = range(parts[0]!, numLayers, "layer");
      experts = range(parts[1]!, numExperts, "expert");
    }
    for (const l of layers) {
      const set = out.get(l) ?? new Set<number>();
      for (const e of experts) set.add(e);
      out.set(l, set);
    }
  }
  return new Map([...out].sort((a, b) => a[0] - b[0]).map(([l, s]) => [l, [...s].sort((a, b) => a - b)]));
}
