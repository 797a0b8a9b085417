// The worker's thread: a dedicated module Web Worker (dist/kvasir-web-thread.js) that runs the
// whole PageWorker (the weights' fetch, the WebSocket session, WebCrypto, the WebAssembly
// kernel, every expert call) off the page's main thread, so a long call never freezes the page,
// and its timers (keepalive, redial) keep their pace while the tab is hidden (Chrome throttles a
// hidden page's main-thread timers hard, not a dedicated worker's). The page (page.ts) keeps the
// UI, the wallet in localStorage (this thread has none: it gets the 32-byte seed and makes its
// own WebWallet) and the Screen Wake Lock; it posts start and stop, and this thread posts
// `WorkerState` snapshots: on a change, at most every STATE_EVERY_MS, and the last one at once.
// Where the browser cannot start a module worker, the page imports this same module on its main
// thread and drives it through `inPage` with the same messages.

import { WebWallet } from "./wallet.js";
import { initialState, PageWorker, type WorkerOptions, type WorkerState } from "./worker.js";

/** A state snapshot goes to the page at most this often (and the last one at once). */
export const STATE_EVERY_MS = 200;
/** The service's counters (calls, rows) are read this often. */
const COUNTERS_EVERY_MS = 250;

export type ThreadOptions = Omit<WorkerOptions, "wallet">;

/** What the page posts to the thread. */
export type ToThread =
  /** Start the worker for the wallet of `seed` (32 bytes). */
  | { kind: "start"; seed: Uint8Array; options: ThreadOptions }
  /** Finish the calls being computed (at most `drainMs`), close the session, dial no more. */
  | { kind: "stop"; drainMs: number };

/** What the thread posts to the page. */
export type FromThread =
  /** The module loaded: the thread takes messages. */
  | { kind: "ready" }
  | { kind: "state"; state: WorkerState }
  /** The answer to "stop": the worker stopped; its last state. */
  | { kind: "stopped"; state: WorkerState }
  /** A message the thread could not act on. */
  | { kind: "error"; message: string };

/** One PageWorker driven by messages; `post` takes what goes back to the page. */
export class ThreadHost {
  private worker: PageWorker | undefined;
  private lastPost = 0;
  private pending: ReturnType<typeof setTimeout> | undefined;
  private counters: ReturnType<typeof setInterval> | undefined;
  private seen = { calls: 0, rows: 0 };
  private stopAsked = false;

  constructor(private readonly post: (msg: FromThread) => void) {}

  async handle(msg: ToThread): Promise<void> {
    switch (msg.kind) {
      case "start": {
        if (this.worker || this.stopAsked) {
          this.post({ kind: "error", message: "this thread's worker was started (or stopped) already" });
          return;
        }
        let wallet: WebWallet;
        try {
          wallet = await WebWallet.fromSeed(msg.seed);
        } catch (exc) {
          this.post({ kind: "error", message: `no wallet from the seed: ${exc instanceof Error ? exc.message : String(exc)}` });
          return;
        }
        if (this.stopAsked) return; // stopped while the wallet was made
        const worker = new PageWorker({ ...msg.options, wallet }, () => this.changed());
        this.worker = worker;
        this.counters = setInterval(() => this.readCounters(), COUNTERS_EVERY_MS);
        await worker.run();
        // Over: refused, failed, or stopped. Its last state goes now.
        this.readCounters();
        clearInterval(this.counters);
        this.flush();
        return;
      }
      case "stop": {
        this.stopAsked = true;
        const worker = this.worker;
        if (worker) await worker.stop(msg.drainMs);
        clearInterval(this.counters);
        worker?.refresh();
        if (this.pending !== undefined) clearTimeout(this.pending);
        this.pending = undefined;
        const state = worker?.state ?? initialState("stopped", "stopped before it started");
        this.post({ kind: "stopped", state });
        return;
      }
    }
  }

  private readCounters(): void {
    const w = this.worker;
    if (!w) return;
    w.refresh();
    const { calls, rows } = w.state;
    if (calls !== this.seen.calls || rows !== this.seen.rows) {
      this.seen = { calls, rows };
      this.changed();
    }
  }

  /** The state changed: a snapshot now, or as soon as STATE_EVERY_MS has passed since the last. */
  private changed(): void {
    if (this.pending !== undefined) return;
    const wait = this.lastPost + STATE_EVERY_MS - performance.now();
    if (wait <= 0) {
      this.flush();
      return;
    }
    this.pending = setTimeout(() => this.flush(), wait);
  }

  private flush(): void {
    if (this.pending !== undefined) clearTimeout(this.pending);
    this.pending = undefined;
    if (!this.worker) return;
    this.lastPost = performance.now();
    this.post({ kind: "state", state: this.worker.state });
  }
}

/** The thread on the page's main thread (where no module worker starts): the same messages,
 * copied as postMessage copies them and delivered after the current task. */
export function inPage(onMessage: (msg: FromThread) => void): { post(msg: ToThread): void } {
  const host = new ThreadHost((msg) => {
    const copy = structuredClone(msg);
    setTimeout(() => onMessage(copy), 0);
  });
  return {
    post: (msg) => {
      const copy = structuredClone(msg);
      setTimeout(() => void host.handle(copy), 0);
    },
  };
}

interface WorkerScope {
  postMessage(msg: FromThread): void;
  addEventListener(type: "message", fn: (ev: MessageEvent<ToThread>) => void): void;
}

// In a dedicated worker (not when the page imports this module as its fallback): serve the page.
const WorkerGlobal = (globalThis as { WorkerGlobalScope?: abstract new () => unknown }).WorkerGlobalScope;
if (WorkerGlobal !== undefined && globalThis instanceof WorkerGlobal) {
  const scope = globalThis as unknown as WorkerScope;
  const host = new ThreadHost((msg) => scope.postMessage(msg));
  scope.addEventListener("message", (ev) => void host.handle(ev.data));
  scope.postMessage({ kind: "ready" });
}
