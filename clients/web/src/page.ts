// The page: its form (hub or gateway URL, model URL, experts, memory), the worker's state
// (connected or not and why, experts held, calls and rows served, KVR credited), the wallet's
// export and import, a stop button, and a Screen Wake Lock while the worker runs. Query
// parameters fill the form (hub=, gateway=, model=, experts=, memory= MiB, kernel=, ledger=,
// balance=, e2e=) and start the worker at once when a URL and a model are given (autostart=0 to
// wait for the button).
//
// The worker itself runs in a dedicated module Web Worker (thread.ts, dist/kvasir-web-thread.js):
// the page posts it start (with the wallet's seed: the thread has no localStorage) and stop, and
// renders the state snapshots it posts. Where the browser cannot start a module worker (or with
// thread=main), the page imports the same module and runs the worker on its own main thread.

import type { FromThread, ThreadOptions, ToThread } from "./thread.js";
import { WebWallet } from "./wallet.js";
import { initialState, kernelChoice, memoryBudget, WORKER_VERSION, type WorkerState } from "./worker.js";

/** The worker thread says it loaded within this long, or the page runs the worker itself. */
const THREAD_READY_MS = 10_000;
/** Stop: the calls being computed get this long to finish. */
const DRAIN_MS = 5000;
/** Stop: the thread reports it stopped within this long (the drain, the close's 3 s, a margin), or it is ended. */
const STOP_DEADLINE_MS = DRAIN_MS + 5000;
/** The ledger's balance is read this often (`balance=`), each read given up after BALANCE_TIMEOUT_MS. */
const BALANCE_EVERY_MS = 5000;
const BALANCE_TIMEOUT_MS = 4000;

const $ = <T extends HTMLElement>(id: string): T => {
  const el = document.getElementById(id);
  if (!el) throw new Error(`the page has no #${id}`);
  return el as T;
};

/** The worker's thread as the page drives it: a dedicated Worker, or the same module on this thread. */
interface Runner {
  post(msg: ToThread): void;
  terminate(): void;
  /** Undefined in a worker thread; why not, on the main thread. */
  mainThread: string | undefined;
}

/** The ledger's GetBalanceResponse as its HTTP read gives it (proto3 JSON: uint64 as decimal strings). */
export interface Credited {
  wallet: string;
  pendingNanoKvr: string;
  pendingKvr: string;
  bytesCredited: string;
  units: string;
  creditCount: string;
}

/** What `window.kvasirWorker.state()` gives: the latest snapshot, and where the worker runs. */
type PageState = WorkerState & { thread: "worker" | "main" };

let wallet: WebWallet | undefined;
let runner: Runner | undefined;
let starting: Promise<void> | undefined;
let snapshot: WorkerState | undefined;
let stopWaiters: (() => void)[] = [];
let wakeLock: WakeLockSentinel | undefined;
let wakeWanted = false;
let credited: Credited | undefined;
let balanceEpoch = 0;
let balanceTimer: ReturnType<typeof setTimeout> | undefined;
const RUNNING = ["loading", "connecting", "connected", "waiting"];

/** What the page exposes as `window.kvasirWorker` (for the tests, and a console). */
interface PageApi {
  version: string;
  address: () => string | undefined;
  /** The wallet's key file (what "Export key file" downloads). */
  keyFile: () => string | undefined;
  importKey: (keyFile: string) => Promise<boolean>;
  /** The latest state the worker's thread reported (undefined before Start). */
  state: () => PageState | undefined;
  /** Stop the worker; resolves once its thread reports it stopped (or STOP_DEADLINE_MS passed). */
  stop: () => Promise<void>;
  wakeLock: () => string;
  /** The ledger's last balance read for this wallet (`balance=`), or undefined. */
  credited: () => Credited | undefined;
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));
const message = (exc: unknown): string => (exc instanceof Error ? exc.message : String(exc));

function text(id: string, value: string): void {
  $(id).textContent = value;
}

function setWake(line: string): void {
  text("wake", line);
}

async function requestWake(): Promise<void> {
  wakeWanted = true;
  const wl = (navigator as Navigator & { wakeLock?: WakeLock }).wakeLock;
  if (!wl) {
    setWake("this browser has no Screen Wake Lock: keep the screen on (and this tab visible) yourself");
    return;
  }
  try {
    wakeLock = await wl.request("screen");
    setWake("held: the screen stays on while the worker runs");
    wakeLock.addEventListener("release", () => {
      wakeLock = undefined;
      if (wakeWanted) setWake("released by the browser (tab hidden?); asked again when the tab is visible");
    });
  } catch (exc) {
    setWake(`refused by the browser (${message(exc)}): keep the screen on yourself`);
  }
}

document.addEventListener("visibilitychange", () => {
  if (wakeWanted && !wakeLock && document.visibilityState === "visible") void requestWake();
});

function showWallet(): void {
  if (!wallet) return;
  text("wallet", wallet.address);
  const ledger = ($("ledger") as HTMLInputElement).value.trim();
  text("balance-cmd", `kvasir balance --wallet ${wallet.address}${ledger ? ` --ledger ${ledger}` : ""}`);
}

function render(): void {
  const s = snapshot;
  if (!s) return;
  const connected = s.phase === "connected";
  const badge = $("status");
  const busy = s.phase === "loading" || s.phase === "connecting";
  badge.textContent = connected ? "connected" : busy ? s.phase : `not connected (${s.phase})`;
  badge.className = connected ? "ok" : s.phase === "refused" || s.phase === "failed" ? "bad" : "wait";
  const main = runner?.mainThread;
  text("detail", main ? `${s.detail} — on the page's main thread: ${main}` : s.detail);
  text("thread", runner ? (main ? `the page's main thread (${main})` : "a dedicated worker thread") : "—");
  const c = s.lastClose;
  text("last-close", c ? `${c.code ?? "-"} ${c.meaning}${c.reason ? ` — ${c.reason}` : ""}` : "—");
  text("experts", s.experts ? `${s.experts} in ${s.layers} layers (${s.slices})` : "—");
  text("kernel", s.kernel || "—");
  text("calls", String(s.calls));
  text("rows", String(s.rows));
  text("fetched", s.fetchedBytes ? `${(s.fetchedBytes / 2 ** 20).toFixed(2)} MiB in ${s.loadMs} ms` : "—");
  text("first-call", s.firstCallMs !== undefined ? `${s.firstCallMs} ms after start` : "—");
  const sealed = s.encrypted ? "yes, AES-256-GCM end to end" : "no (a hub dialled directly, in the clear)";
  text("encrypted", s.phase === "connected" ? sealed : "—");
  text("log", s.log.slice(-40).join("\n"));
  ($("stop") as HTMLButtonElement).disabled = !RUNNING.includes(s.phase);
  ($("start") as HTMLButtonElement).disabled = RUNNING.includes(s.phase) || starting !== undefined;
}

function onThread(msg: FromThread): void {
  switch (msg.kind) {
    case "ready":
      return;
    case "state":
      snapshot = msg.state;
      break;
    case "stopped":
      snapshot = msg.state;
      for (const w of stopWaiters.splice(0)) w();
      break;
    case "error":
      console.log(`kvasir-web-worker: ${msg.message}`);
      snapshot = { ...(snapshot ?? initialState()), phase: "failed", detail: msg.message };
      break;
  }
  render();
}

/** The worker's thread: a dedicated module Worker that said it loaded, else this module on the
 * page's main thread (`forceMain`: thread=main). */
async function openRunner(forceMain: boolean): Promise<Runner> {
  const url = new URL("kvasir-web-thread.js", import.meta.url);
  let why = "asked for with thread=main";
  if (!forceMain) {
    let worker: Worker | undefined;
    try {
      const w = new Worker(url, { type: "module", name: "kvasir-worker" });
      worker = w;
      const failed = await new Promise<string | undefined>((resolve) => {
        const t = setTimeout(() => resolve(`it did not start within ${THREAD_READY_MS / 1000} s`), THREAD_READY_MS);
        w.onmessage = (ev: MessageEvent<FromThread>) => {
          if (ev.data?.kind !== "ready") return;
          clearTimeout(t);
          resolve(undefined);
        };
        w.onerror = (ev: ErrorEvent) => {
          ev.preventDefault();
          clearTimeout(t);
          resolve(ev.message || "its module did not load");
        };
      });
      if (failed === undefined) {
        w.onmessage = (ev: MessageEvent<FromThread>) => onThread(ev.data);
        w.onmessageerror = () => onThread({ kind: "error", message: "a message from the worker thread did not arrive whole" });
        w.onerror = (ev: ErrorEvent) => {
          ev.preventDefault();
          onThread({ kind: "error", message: `the worker thread failed: ${ev.message || "an error"}` });
        };
        return { post: (m) => w.postMessage(m), terminate: () => w.terminate(), mainThread: undefined };
      }
      why = `this browser did not start a module worker (${failed})`;
    } catch (exc) {
      why = `this browser cannot start a module worker (${message(exc)})`;
    }
    worker?.terminate();
  }
  console.log(`kvasir-web-worker: running on the page's main thread: ${why}`);
  const mod = (await import(url.href)) as typeof import("./thread.js");
  const port = mod.inPage(onThread);
  return { post: (m) => port.post(m), terminate: () => undefined, mainThread: why };
}

function dialUrl(): string {
  const hub = ($("hub") as HTMLInputElement).value.trim();
  const gw = ($("gateway") as HTMLInputElement).value.trim();
  if (gw) {
    const u = new URL(gw);
    if (u.pathname === "" || u.pathname === "/") u.pathname = "/v1/worker";
    return u.toString();
  }
  return hub;
}

async function start(): Promise<void> {
  if (!wallet || starting || (snapshot && RUNNING.includes(snapshot.phase))) return;
  let url: string;
  try {
    url = dialUrl();
  } catch {
    text("detail", "the gateway's URL is not a URL (wss://HOST[:PORT])");
    return;
  }
  const model = ($("model") as HTMLInputElement).value.trim();
  if (!url || !model) {
    text("detail", "give a gateway (wss://) or hub (ws://) URL and the model's URL");
    return;
  }
  const mib = Number(($("memory") as HTMLInputElement).value);
  const kernel = kernelChoice(($("kernel-choice") as HTMLSelectElement).value);
  const q = new URLSearchParams(location.search);
  const e2e = q.get("e2e");
  const options: ThreadOptions = {
    url,
    model,
    experts: ($("experts-spec") as HTMLInputElement).value.trim() || "all",
    budgetBytes: mib > 0 ? mib * 2 ** 20 : undefined,
    kernel,
    wasmUrl: new URL("kernel.wasm", import.meta.url).toString(),
    requireEncryption: e2e === "require" ? true : e2e === "auto" ? false : undefined,
  };
  const seed = wallet.seed.slice();
  // A thread whose worker ended (refused, failed, stopped) is not reused.
  runner?.terminate();
  runner = undefined;
  snapshot = initialState("loading", "starting the worker's thread");
  const opening = (async () => {
    runner = await openRunner(q.get("thread") === "main");
    runner.post({ kind: "start", seed, options });
  })();
  starting = opening.catch(() => undefined).finally(() => (starting = undefined));
  render();
  void requestWake();
  try {
    await opening;
  } catch (exc) {
    onThread({ kind: "error", message: `the worker's module did not load: ${message(exc)}` });
  }
  render();
}

async function stop(): Promise<void> {
  wakeWanted = false;
  await starting;
  const r = runner;
  if (r) {
    const reported = new Promise<boolean>((resolve) => stopWaiters.push(() => resolve(true)));
    r.post({ kind: "stop", drainMs: DRAIN_MS });
    const ok = await Promise.race([reported, sleep(STOP_DEADLINE_MS).then(() => false)]);
    if (!ok) {
      const why = `the worker's thread did not report stopping within ${STOP_DEADLINE_MS / 1000} s: ended it`;
      console.log(`kvasir-web-worker: ${why}`);
      snapshot = { ...(snapshot ?? initialState()), phase: "stopped", detail: why };
    }
    stopWaiters = [];
    // Its calls drained and its session closed: the thread has nothing left to do.
    r.terminate();
  }
  if (wakeLock) await wakeLock.release().catch(() => undefined);
  wakeLock = undefined;
  setWake("released (stopped)");
  render();
}

function exportKey(): void {
  if (!wallet) return;
  const blob = new Blob([wallet.keyFile()], { type: "text/plain" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = "wallet.key";
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 10_000);
}

/** Take the wallet of a key file's text (kept in this browser from now on); false if refused. */
async function importKey(keyFile: string): Promise<boolean> {
  try {
    const next = await WebWallet.fromKeyFile(keyFile);
    if (starting || (snapshot && RUNNING.includes(snapshot.phase))) {
      text("wallet-msg", "stop the worker before importing a wallet key");
      return false;
    }
    next.store();
    wallet = next;
    text("wallet-msg", "imported: this page now earns for that wallet");
    showWallet();
    restartBalance();
    return true;
  } catch (exc) {
    text("wallet-msg", `not imported: ${message(exc)}`);
    return false;
  }
}

// -- KVR credited: the ledger's HTTP read (`ledger serve --http`), GET /v1/balance/WALLET -----------

function balanceBase(): string {
  return ($("balance") as HTMLInputElement).value.trim().replace(/\/+$/, "");
}

/** The balance in a 200 answer's body, checked; throws with what is wrong. */
function parseCredited(body: string, address: string): Credited {
  let got: Record<string, unknown>;
  try {
    got = JSON.parse(body) as Record<string, unknown>;
  } catch {
    throw new Error(`not JSON: ${body.slice(0, 80)}`);
  }
  const field = (name: keyof Credited, pattern: RegExp): string => {
    const v = got?.[name];
    const s = typeof v === "number" ? String(v) : v;
    if (typeof s !== "string" || !pattern.test(s)) throw new Error(`no ${name} in the answer`);
    return s;
  };
  const whole = /^\d+$/;
  const decimal = /^\d+(\.\d+)?$/;
  const c: Credited = {
    wallet: field("wallet", /^[0-9a-f]{64}$/),
    pendingNanoKvr: field("pendingNanoKvr", whole),
    pendingKvr: field("pendingKvr", decimal),
    bytesCredited: field("bytesCredited", whole),
    units: field("units", decimal),
    creditCount: field("creditCount", whole),
  };
  if (c.wallet !== address) throw new Error(`the answer is for another wallet (${c.wallet.slice(0, 16)}…)`);
  return c;
}

const clock = (): string => new Date().toTimeString().slice(0, 8);

/** One read of the balance; its line, and `credited` when it parsed. */
async function readBalance(base: string, address: string): Promise<{ line: string; got?: Credited }> {
  const url = `${base}/v1/balance/${address}`;
  const ctl = new AbortController();
  const t = setTimeout(() => ctl.abort(), BALANCE_TIMEOUT_MS);
  try {
    const res = await fetch(url, { signal: ctl.signal, cache: "no-store" });
    const body = await res.text();
    if (!res.ok) {
      const first = body.trim().split("\n")[0]?.slice(0, 200) ?? "";
      return { line: `HTTP ${res.status}${first ? `: ${first}` : ""} from ${url}` };
    }
    try {
      return { line: `read at ${clock()} from ${base}`, got: parseCredited(body, address) };
    } catch (exc) {
      // An answer, but not this wallet's balance: a server that is not a ledger, or one that lies.
      return { line: `not this wallet's balance from ${url}: ${message(exc)}` };
    }
  } catch (exc) {
    if (ctl.signal.aborted) return { line: `no answer within ${BALANCE_TIMEOUT_MS / 1000} s from ${url}` };
    let why = `network error (${message(exc)}): is the ledger serving --http there, and reachable from this page?`;
    if (location.protocol === "https:" && url.startsWith("http:")) {
      why += " This page is https:// and the URL http://: the browser blocks that (mixed content) but to localhost;" +
        " serve the ledger's HTTP over https://.";
    }
    return { line: why };
  } finally {
    clearTimeout(t);
  }
}

function showCredited(): void {
  text("credited", credited
    ? `KVR credited: ${credited.pendingKvr} KVR (${credited.bytesCredited} B in ${credited.creditCount} ` +
      `receipt${credited.creditCount === "1" ? "" : "s"})`
    : "KVR credited: —");
}

/** Read the balance now and every BALANCE_EVERY_MS after the last read ended (never two at once). */
function restartBalance(): void {
  balanceEpoch += 1;
  const epoch = balanceEpoch;
  if (balanceTimer !== undefined) clearTimeout(balanceTimer);
  balanceTimer = undefined;
  credited = undefined;
  showCredited();
  const base = balanceBase();
  if (!wallet || !base) {
    text("credited-at", "give the ledger's HTTP URL (balance) to read it here, or run:");
    return;
  }
  const address = wallet.address;
  text("credited-at", `reading ${base}…`);
  const poll = async (): Promise<void> => {
    const { line, got } = await readBalance(base, address);
    if (epoch !== balanceEpoch) return;
    if (got) credited = got;
    showCredited();
    text("credited-at", got || !credited ? line : `not read at ${clock()}: ${line}`);
    balanceTimer = setTimeout(() => void poll(), BALANCE_EVERY_MS);
  };
  void poll();
}

async function init(): Promise<void> {
  const q = new URLSearchParams(location.search);
  for (const id of ["hub", "gateway", "model", "ledger", "balance"]) ($(id) as HTMLInputElement).value = q.get(id) ?? "";
  ($("experts-spec") as HTMLInputElement).value = q.get("experts") ?? "all";
  ($("memory") as HTMLInputElement).value = q.get("memory") ?? "";
  ($("kernel-choice") as HTMLSelectElement).value = kernelChoice(q.get("kernel"));
  const budget = memoryBudget(undefined);
  ($("memory") as HTMLInputElement).placeholder = `${Math.round(budget.bytes / 2 ** 20)} (${budget.source})`;
  text("version", WORKER_VERSION);
  try {
    const got = await WebWallet.loadOrCreate();
    wallet = got.wallet;
    const made = "a new wallet, kept in this browser: export its key to keep your credits";
    text("wallet-msg", got.created ? made : "kept in this browser");
  } catch (exc) {
    text("wallet-msg", `no wallet: ${message(exc)}`);
    return;
  }
  showWallet();
  restartBalance();
  $("ledger").addEventListener("input", showWallet);
  $("balance").addEventListener("change", restartBalance);
  $("start").addEventListener("click", () => void start());
  $("stop").addEventListener("click", () => void stop());
  $("export").addEventListener("click", exportKey);
  $("import").addEventListener("change", (ev) => {
    const f = (ev.target as HTMLInputElement).files?.[0];
    if (f) void f.text().then(importKey);
  });
  const api: PageApi = {
    version: WORKER_VERSION,
    address: () => wallet?.address,
    keyFile: () => wallet?.keyFile(),
    importKey,
    state: () => (snapshot ? { ...snapshot, thread: runner?.mainThread ? "main" : "worker" } : undefined),
    stop,
    wakeLock: () => $("wake").textContent ?? "",
    credited: () => credited,
  };
  (globalThis as unknown as { kvasirWorker: PageApi }).kvasirWorker = api;
  if ((q.get("hub") || q.get("gateway")) && q.get("model") && q.get("autostart") !== "0") await start();
}

void init();
