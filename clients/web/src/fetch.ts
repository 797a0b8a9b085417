// The worker's slice of a checkpoint fetched by the byte from its URL (a folder in the Hugging
// Face layout: https://huggingface.co/ORG/REPO/resolve/REV/, or any server of the same files that
// honours Range): config.json and model.safetensors.index.json whole (or a single
// model.safetensors), each shard's header with two Range requests (8 bytes of length, then the
// JSON), then only the bytes of the chosen experts' tensors, adjacent spans merged, each answer
// checked to be 206 with the asked Content-Range. What the bytes mean is checkpoint_core.ts's.

import {
  CheckpointError,
  ExpertIndexCore,
  indexedFiles,
  modelInfoFromConfig,
  parseSafetensorsHeader,
  safetensorsHeaderLength,
  type TensorEntry,
  type TensorSpan,
} from "../../ts/src/worker/checkpoint_core.js";

/** One Range request at most. */
const PIECE_BYTES = 16 << 20;
const TIMEOUT_MS = 60_000;

export class FetchError extends Error {
  override name = "FetchError";
}

/** The folder URL `url` names, ending with "/". */
export function baseUrl(url: string): string {
  const u = new URL(url, globalThis.location?.href);
  if (!u.pathname.endsWith("/")) u.pathname += "/";
  return u.toString();
}

async function get(url: string, range?: [number, number]): Promise<Response> {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), TIMEOUT_MS);
  try {
    const headers: Record<string, string> = range ? { Range: `bytes=${range[0]}-${range[1] - 1}` } : {};
    return await fetch(url, { headers, signal: ctl.signal, cache: "no-store" });
  } catch (exc) {
    const why = exc instanceof Error ? exc.message : String(exc);
    throw new FetchError(`${url}: ${why} (unreachable, or the server sends no CORS headers)`);
  } finally {
    clearTimeout(timer);
  }
}

/** Bytes [a, b) of `url` by a Range request; `total` set to the file's size from Content-Range. */
async function getRange(url: string, a: number, b: number): Promise<{ bytes: Uint8Array; total: number }> {
  const resp = await get(url, [a, b]);
  if (resp.status !== 206) {
    throw new FetchError(
      resp.status === 200
        ? `${url}: the server answered a Range request with the whole file (HTTP 200): ` +
            "serve the checkpoint with a server that honours Range"
        : `${url}: HTTP ${resp.status} for bytes ${a}-${b - 1}`,
    );
  }
  const m = /^bytes (\d+)-(\d+)\/(\d+|\*)$/.exec((resp.headers.get("Content-Range") ?? "").trim());
  if (!m || Number(m[1]) !== a || Number(m[2]) !== b - 1) {
    throw new FetchError(
      `${url}: asked for bytes ${a}-${b - 1}, the server answered Content-Range ${resp.headers.get("Content-Range")} ` +
        "(is it exposed to the page: Access-Control-Expose-Headers?)",
    );
  }
  const bytes = new Uint8Array(await resp.arrayBuffer());
  if (bytes.byteLength !== b - a) throw new FetchError(`${url}: asked for ${b - a} bytes, got ${bytes.byteLength}`);
  return { bytes, total: m[3] === "*" ? -1 : Number(m[3]) };
}

async function getText(url: string, optional = false): Promise<string | undefined> {
  const resp = await get(url);
  if (optional && resp.status === 404) return undefined;
  if (!resp.ok) throw new FetchError(`${url}: HTTP ${resp.status}`);
  return resp.text();
}

/** What the page has fetched: bytes of the shard files by span. */
class SpanCache {
  private readonly pieces = new Map<string, { start: number; bytes: Uint8Array }[]>();
  fetched = 0;

  add(file: string, start: number, bytes: Uint8Array): void {
    const list = this.pieces.get(file) ?? [];
    list.push({ start, bytes });
    this.pieces.set(file, list);
    this.fetched += bytes.byteLength;
  }

  read(t: TensorEntry, start: number, end: number): Uint8Array {
    for (const p of this.pieces.get(t.file) ?? []) {
      if (p.start <= start && end <= p.start + p.bytes.byteLength) return p.bytes.slice(start - p.start, end - p.start);
    }
    throw new CheckpointError(`${t.file}: bytes ${start}-${end - 1} of ${t.key} were not fetched`);
  }

  /** Free the fetched bytes (the experts keep their own copies). */
  clear(): void {
    this.pieces.clear();
  }
}

/** A quantized release (FP8, MXFP4, compressed-tensors: config.json's quantization_config) is
 *  refused before any weight is fetched: the page has no dequantization; the Python worker
 *  serves those releases. */
function refuseQuantized(base: string, cfg: Record<string, unknown>): void {
  const text = cfg["text_config"];
  for (const c of [cfg, typeof text === "object" && text !== null ? (text as Record<string, unknown>) : {}]) {
    const q = c["quantization_config"];
    if (typeof q !== "object" || q === null) continue;
    const method = String((q as Record<string, unknown>)["quant_method"] ?? "unknown");
    throw new CheckpointError(
      `${base}: a quantized release (quant_method ${method}): this page serves float32, bfloat16 and ` +
        `float16 weights only; serve it with the Python worker (python -m worker --model URL)`,
    );
  }
}

/** A checkpoint at a URL: its headers read, ready to fetch experts' bytes. */
export class RemoteCheckpoint {
  readonly index: ExpertIndexCore;
  private readonly cache = new SpanCache();

  private constructor(
    readonly base: string,
    tensors: Map<string, TensorEntry>,
    cfg: Record<string, unknown>,
  ) {
    const info = modelInfoFromConfig(`${base}config.json`, cfg, () => tensors);
    this.index = new ExpertIndexCore(base, tensors, info, (t, a, b) => this.cache.read(t, a, b));
  }

  /** Read config.json, the shard list and every shard's header (two Range requests each). */
  static async open(url: string): Promise<RemoteCheckpoint> {
    const base = baseUrl(url);
    const cfgText = await getText(`${base}config.json`);
    let cfg: Record<string, unknown>;
    try {
      cfg = JSON.parse(cfgText!) as Record<string, unknown>;
    } catch (exc) {
      throw new CheckpointError(`${base}config.json: ${String(exc)}`);
    }
    refuseQuantized(base, cfg);
    const indexText = await getText(`${base}model.safetensors.index.json`, true);
    const files = indexText !== undefined ? indexedFiles(indexText) : ["model.safetensors"];
    const tensors = new Map<string, TensorEntry>();
    for (const f of files) {
      const file = `${base}${f}`;
      const head = await getRange(file, 0, 8);
      const n = safetensorsHeaderLength(file, head.bytes);
      const json = await getRange(file, 8, 8 + n);
      const size = head.total < 0 ? Infinity : head.total;
      for (const [k, v] of parseSafetensorsHeader(file, n, json.bytes, size)) tensors.set(k, v);
    }
    return new RemoteCheckpoint(base, tensors, cfg);
  }

  /** Bytes an expert's tensors take as stored. */
  storedBytes(layer: number, expert: number): number {
    return this.index.spans(layer, expert).reduce((a, s) => a + s.end - s.start, 0);
  }

  /** Fetch the bytes of `experts` ([layer, expert]), adjacent spans merged; `progress(bytes)` as they come. */
  async fetchExperts(experts: [number, number][], progress: (bytes: number) => void = () => undefined): Promise<void> {
    const byFile = new Map<string, TensorSpan[]>();
    for (const [l, e] of experts) {
      for (const s of this.index.spans(l, e)) {
        const list = byFile.get(s.tensor.file) ?? [];
        list.push(s);
        byFile.set(s.tensor.file, list);
      }
    }
    for (const [file, spans] of byFile) {
      spans.sort((a, b) => a.start - b.start);
      const merged: [number, number][] = [];
      for (const s of spans) {
        const last = merged[merged.length - 1];
        if (last && s.start <= last[1]) last[1] = Math.max(last[1], s.end);
        else merged.push([s.start, s.end]);
      }
      for (const [a, b] of merged) {
        // One piece per merged span, split into requests of PIECE_BYTES at most.
        const whole = new Uint8Array(b - a);
        for (let at = a; at < b; at += PIECE_BYTES) {
          const end = Math.min(b, at + PIECE_BYTES);
          whole.set((await getRange(file, at, end)).bytes, at - a);
          progress(end - at);
        }
        this.cache.add(file, a, whole);
      }
    }
  }

  get fetchedBytes(): number {
    return this.cache.fetched;
  }

  release(): void {
    this.cache.clear();
  }
}
