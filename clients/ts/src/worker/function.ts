// The expert function a checkpoint computes (PROTOCOL.md 11.2), read from the checkpoint
// alone, and how the hello announces it (HelloBody.expert_function, field 14).

import { create } from "@bufbuild/protobuf";

import { ExpertFunctionSchema, ExpertGate, type ExpertFunction as ExpertFunctionMsg } from "../gen/kvasir/v1/function_pb.js";
import type { HelloBody } from "../gen/kvasir/v1/session_pb.js";
import { CheckpointError, type ExpertIndexCore } from "./checkpoint_core.js";
import type { ExpertFunction } from "./expert.js";

/** The function of a config (its text_config) and the expert tensors' traits (11.2): with
 * `swiglu_alpha` and `swiglu_limit`, the clamped SwiGLU (interleaved when stored transposed, as
 * gpt-oss's; concatenated otherwise, as MiniMax-M3's); with `swiglu_limit` alone, the clamped GLU
 * with `hidden_act`; else GLU with `hidden_act`. */
export function functionFromConfig(text: Record<string, unknown>, traits: { transposed: boolean; bias: boolean }): ExpertFunction {
  const limit = text.swiglu_limit;
  const alpha = text.swiglu_alpha;
  const activation = String(text.hidden_act ?? "silu");
  if (limit !== undefined && limit !== null) {
    if (typeof limit !== "number") throw new CheckpointError(`swiglu_limit is not a number`);
    if (alpha !== undefined && alpha !== null) {
      if (typeof alpha !== "number") throw new CheckpointError(`swiglu_alpha is not a number`);
      return { gate: "clamped_swiglu", activation: "", alpha, limit, interleaved: traits.transposed, ...traits };
    }
    return { gate: "clamped_glu", activation, alpha: 0, limit, interleaved: false, ...traits };
  }
  return { gate: "glu", activation, alpha: 0, limit: 0, interleaved: false, ...traits };
}

/** The expert function of the checkpoint `index` reads. */
export function functionOfCheckpoint(index: ExpertIndexCore): ExpertFunction {
  return functionFromConfig(index.info.text, { transposed: index.transposed, bias: index.hasBias });
}

/** `fn` as a kvasir.v1.ExpertFunction (no layers: a hello's function is for all its slices). */
export function functionToProto(fn: ExpertFunction): ExpertFunctionMsg {
  return create(ExpertFunctionSchema, {
    gate: fn.gate === "glu" ? ExpertGate.GLU : fn.gate === "clamped_glu" ? ExpertGate.CLAMPED_GLU : ExpertGate.CLAMPED_SWIGLU,
    activation: fn.gate === "clamped_swiglu" ? "" : fn.activation,
    alpha: fn.alpha,
    limit: fn.limit,
    interleaved: fn.interleaved,
    transposed: fn.transposed,
    bias: fn.bias,
  });
}

/** The function a kvasir.v1.ExpertFunction describes; unset fields as 11.2 says (the default
 * activation: the checkpoint's hidden_act). Throws for a gate this worker does not know. */
export function functionFromProto(msg: ExpertFunctionMsg, defaultActivation: string): ExpertFunction {
  const traits = { interleaved: msg.interleaved, transposed: msg.transposed, bias: msg.bias };
  if (msg.gate === ExpertGate.UNSPECIFIED || msg.gate === ExpertGate.GLU) {
    return { gate: "glu", activation: msg.activation || defaultActivation, alpha: msg.alpha, limit: msg.limit, ...traits };
  }
  if (msg.gate === ExpertGate.CLAMPED_GLU) {
    return { gate: "clamped_glu", activation: msg.activation || defaultActivation, alpha: msg.alpha, limit: msg.limit, ...traits };
  }
  if (msg.gate === ExpertGate.CLAMPED_SWIGLU) {
    return { gate: "clamped_swiglu", activation: "", alpha: msg.alpha, limit: msg.limit, ...traits };
  }
  throw new Error(`expert gate ${msg.gate} is not one this worker computes`);
}

/** The HelloBody fields that announce `fn` (11.2: every worker announces its function). */
export function helloFunction(fn: ExpertFunction): Partial<HelloBody> {
  return { expertFunction: functionToProto(fn) };
}
