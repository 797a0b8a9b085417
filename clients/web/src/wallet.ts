// The wallet in a web page (PROTOCOL.md 4.4): an Ed25519 key made once and kept in the page's
// localStorage, so a reload earns for the same wallet; exported and imported as the key file
// every Kvasir worker reads (`.kvasir/wallet.key`: the 32-byte seed as 64 lowercase hex
// characters and a newline), so the credits stay with the user, not the tab.

import { fromHex, toHex } from "../../ts/src/worker/bytes_core.js";
import { isAddress } from "../../ts/src/worker/handshake_core.js";
import { ed25519FromSeed, ed25519Sign } from "./crypto.js";

export const WALLET_STORAGE_KEY = "kvasir.wallet.key";

export class WebWallet {
  private constructor(
    readonly seed: Uint8Array,
    private readonly key: CryptoKey,
    readonly address: string,
  ) {}

  static async fromSeed(seed: Uint8Array): Promise<WebWallet> {
    const { key, address } = await ed25519FromSeed(seed);
    return new WebWallet(seed.slice(), key, address);
  }

  /** A wallet from a key file's text; throws unless it is 64 hex characters (and a newline). */
  static async fromKeyFile(text: string): Promise<WebWallet> {
    const t = text.trim().toLowerCase();
    if (!isAddress(t)) throw new Error("a wallet key file holds 64 hex characters (an Ed25519 seed)");
    return WebWallet.fromSeed(fromHex(t));
  }

  /** The stored wallet, or a new one stored now. */
  static async loadOrCreate(
    storage: Storage | undefined = globalThis.localStorage,
  ): Promise<{ wallet: WebWallet; created: boolean }> {
    const kept = storage?.getItem(WALLET_STORAGE_KEY);
    if (kept) return { wallet: await WebWallet.fromKeyFile(kept), created: false };
    const wallet = await WebWallet.fromSeed(crypto.getRandomValues(new Uint8Array(32)));
    wallet.store(storage);
    return { wallet, created: true };
  }

  store(storage: Storage | undefined = globalThis.localStorage): void {
    storage?.setItem(WALLET_STORAGE_KEY, this.keyFile().trim());
  }

  /** The key file's text (what `python -m worker --wallet FILE` and the Node worker read). */
  keyFile(): string {
    return `${toHex(this.seed)}\n`;
  }

  sign(message: Uint8Array): Promise<Uint8Array> {
    return ed25519Sign(this.key, message);
  }
}
