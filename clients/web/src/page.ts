// The page: its form (hub or gateway URL, model URL, experts, memory), the worker's state
// (connected or not and why, experts held, calls and rows served, KVR), the wallet's export
// and import, a stop button, and a Screen Wake Lock while the worker runs. Query parameters
// fill the form (hub=, gateway=, model=, experts=, memory= MiB, kernel=, ledger=, e2e=) and start
// the worker at once when a URL and a model are given (autostart=0 to wait for the button).

import { WebWallet } from "./wallet.js";
import { memoryBudget, PageWorker, WORKER_VERSION, type WorkerState } from "./worker.js";

const $ = <T extends HTMLElement>(id: string): T => {
  const el = document.getElementById(id);
  if (!el) throw new Error(`the page has no #${id}`);
  return el as T;
};

let wallet: WebWallet | undefined;
let worker: PageWorker | undefined;
let wakeLock: WakeLockSentinel | undefined;
let wakeWanted = false;
const RUNNING = ["loading", "connecting", "connected", "waiting"];

/** What the page exposes as `window.kvasirWorker` (for the tests, and a console). */
interface PageApi {
  version: string;
  address: () => string | undefined;
  /** The wallet's key file (what "Export key file" downloads). */
  keyFile: () => string | undefined;
  importKey: (keyFile: string) => Promise<boolean>;
  state: () => WorkerState | undefined;
  stop: () => Promise<void>;
  wakeLock: () => string;
}

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
    const why = exc instanceof Error ? exc.message : String(exc);
    setWake(`refused by the browser (${why}): keep the screen on yourself`);
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
  const s = worker?.state;
  if (!s) return;
  worker!.refresh();
  const connected = s.phase === "connected";
  const badge = $("status");
  const busy = s.phase === "loading" || s.phase === "connecting";
  badge.textContent = connected ? "connected" : busy ? s.phase : `not connected (${s.phase})`;
  badge.className = connected ? "ok" : s.phase === "refused" || s.phase === "failed" ? "bad" : "wait";
  text("detail", s.detail);
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
  ($("start") as HTMLButtonElement).disabled = RUNNING.includes(s.phase);
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
  if (!wallet) return;
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
  const kernel = ($("kernel-choice") as HTMLSelectElement).value === "js" ? "js" : "wasm";
  const e2e = new URLSearchParams(location.search).get("e2e");
  worker = new PageWorker(
    {
      url,
      model,
      wallet,
      experts: ($("experts-spec") as HTMLInputElement).value.trim() || "all",
      budgetBytes: mib > 0 ? mib * 2 ** 20 : undefined,
      kernel,
      wasmUrl: new URL("kernel.wasm", import.meta.url).toString(),
      requireEncryption: e2e === "require" ? true : e2e === "auto" ? false : undefined,
    },
    render,
  );
  void requestWake();
  await worker.run();
  render();
}

async function stop(): Promise<void> {
  wakeWanted = false;
  await worker?.stop();
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
    if (worker && RUNNING.includes(worker.state.phase)) {
      text("wallet-msg", "stop the worker before importing a wallet key");
      return false;
    }
    next.store();
    wallet = next;
    text("wallet-msg", "imported: this page now earns for that wallet");
    showWallet();
    return true;
  } catch (exc) {
    text("wallet-msg", `not imported: ${exc instanceof Error ? exc.message : String(exc)}`);
    return false;
  }
}

async function init(): Promise<void> {
  const q = new URLSearchParams(location.search);
  for (const id of ["hub", "gateway", "model", "ledger"]) ($(id) as HTMLInputElement).value = q.get(id) ?? "";
  ($("experts-spec") as HTMLInputElement).value = q.get("experts") ?? "all";
  ($("memory") as HTMLInputElement).value = q.get("memory") ?? "";
  ($("kernel-choice") as HTMLSelectElement).value = q.get("kernel") === "js" ? "js" : "wasm";
  const budget = memoryBudget(undefined);
  ($("memory") as HTMLInputElement).placeholder = `${Math.round(budget.bytes / 2 ** 20)} (${budget.source})`;
  text("version", WORKER_VERSION);
  try {
    const got = await WebWallet.loadOrCreate();
    wallet = got.wallet;
    const made = "a new wallet, kept in this browser: export its key to keep your credits";
    text("wallet-msg", got.created ? made : "kept in this browser");
  } catch (exc) {
    text("wallet-msg", `no wallet: ${exc instanceof Error ? exc.message : String(exc)}`);
    return;
  }
  showWallet();
  $("ledger").addEventListener("input", showWallet);
  $("start").addEventListener("click", () => void start());
  $("stop").addEventListener("click", () => void stop());
  $("export").addEventListener("click", exportKey);
  $("import").addEventListener("change", (ev) => {
    const f = (ev.target as HTMLInputElement).files?.[0];
    if (f) void f.text().then(importKey);
  });
  setInterval(render, 500);
  const api: PageApi = {
    version: WORKER_VERSION,
    address: () => wallet?.address,
    keyFile: () => wallet?.keyFile(),
    importKey,
    state: () => {
      worker?.refresh();
      return worker?.state;
    },
    stop,
    wakeLock: () => $("wake").textContent ?? "",
  };
  (globalThis as unknown as { kvasirWorker: PageApi }).kvasirWorker = api;
  if ((q.get("hub") || q.get("gateway")) && q.get("model") && q.get("autostart") !== "0") await start();
}

void init();
