// Reading a Hugging Face Mixture-of-Experts checkpoint (PROTOCOL.md 11): config.json (its
// text_config when present) and the expert tensors of the safetensors files, read by byte
// range from each file's header (8 bytes of little-endian header length, then JSON). What the
// bytes mean is checkpoint_core.ts's (no Node API); the files are read here.

import { closeSync, existsSync, openSync, readdirSync, readFileSync, readSync, statSync } from "node:fs";
import { join } from "node:path";

import {
  CheckpointError,
  ExpertIndexCore,
  indexedFiles,
  modelInfoFromConfig,
  parseSafetensorsHeader,
  safetensorsHeaderLength,
  type ModelInfo,
  type TensorEntry,
} from "./checkpoint_core.js";

export * from "./checkpoint_core.js";

/** The tensors listed in one safetensors file's header. Throws CheckpointError when it does not parse. */
export function readSafetensorsHeader(file: string): Map<string, TensorEntry> {
  const fd = openSync(file, "r");
  try {
    const head = Buffer.alloc(8);
    if (readSync(fd, head, 0, 8, 0) !== 8) throw new CheckpointError(`${file}: shorter than a safetensors header`);
    const n = safetensorsHeaderLength(file, head);
    const buf = Buffer.alloc(n);
    if (readSync(fd, buf, 0, n, 8) !== n) throw new CheckpointError(`${file}: truncated safetensors header`);
    return parseSafetensorsHeader(file, n, buf, statSync(file).size);
  } finally {
    closeSync(fd);
  }
}

/** The bytes of `t`, read from its file. */
export function readTensorBytes(t: TensorEntry, start = t.start, end = t.end): Uint8Array {
  const fd = openSync(t.file, "r");
  try {
    const out = new Uint8Array(end - start);
    let at = 0;
    while (at < out.byteLength) {
      const got = readSync(fd, out, at, out.byteLength - at, start + at);
      if (got <= 0) throw new CheckpointError(`${t.file}: shorter than its header says; was it changed while in use?`);
      at += got;
    }
    return out;
  } finally {
    closeSync(fd);
  }
}

/** Every tensor of the checkpoint folder: from model.safetensors.index.json's files when present, else every *.safetensors. */
export function checkpointTensors(dir: string): Map<string, TensorEntry> {
  const index = join(dir, "model.safetensors.index.json");
  let files: string[];
  if (existsSync(index)) {
    files = indexedFiles(readFileSync(index, "utf8"));
  } else {
    files = readdirSync(dir).filter((f) => f.endsWith(".safetensors")).sort();
  }
  if (files.length === 0) throw new CheckpointError(`${dir}: no *.safetensors files`);
  const out = new Map<string, TensorEntry>();
  for (const f of files) for (const [k, v] of readSafetensorsHeader(join(dir, f))) out.set(k, v);
  return out;
}

/** The facts of PROTOCOL.md 11 from `dir/config.json` (and the tensors, where the config names no expert count). */
export function readModelInfo(dir: string, tensors?: Map<string, TensorEntry>): ModelInfo {
  const path = join(dir, "config.json");
  let cfg: Record<string, unknown>;
  try {
    cfg = JSON.parse(readFileSync(path, "utf8")) as Record<string, unknown>;
  } catch (exc) {
    throw new CheckpointError(`${path}: ${exc instanceof Error ? exc.message : String(exc)}: --model must be a Hugging Face checkpoint folder`);
  }
  return modelInfoFromConfig(path, cfg, () => tensors ?? checkpointTensors(dir));
}

/** Where each (layer, expert)'s weights are in the checkpoint folder `dir`. Opening reads only headers. */
export class ExpertIndex extends ExpertIndexCore {
  constructor(dir: string) {
    if (!existsSync(dir) || !statSync(dir).isDirectory()) throw new CheckpointError(`${dir} is not a checkpoint folder`);
    const tensors = checkpointTensors(dir);
    super(dir, tensors, readModelInfo(dir, tensors), readTensorBytes);
  }
}
