// The worker's side of the session handshake (PROTOCOL.md 4.1 to 4.3) with WebCrypto: what the
// messages hold and how they are checked is handshake_core.ts's (shared with the Node worker);
// here only the signatures, the hashes and the key exchange, which are asynchronous.

import type { SessionChallenge } from "../../ts/src/gen/kvasir/v1/session_pb.js";
import { AEAD_AES_256_GCM } from "../../ts/src/worker/channel_core.js";
import {
  acceptSignedMessage,
  badAccept,
  badSignature,
  checkAeadsOffered,
  helloBody,
  helloMessage,
  helloSignedMessage,
  parseAccept,
  parseChallenge,
  transcriptMessage,
  type HandshakeOptions,
  type HelloFacts,
} from "../../ts/src/worker/handshake_core.js";
import { CloseCode, ProtocolError } from "../../ts/src/worker/bytes_core.js";
import { deriveTunnelKeys, ed25519Verify, sha256, WebCipher, WebKeyExchange } from "./crypto.js";
import type { WebWallet } from "./wallet.js";

export interface WebAccepted {
  sessionId: string;
  encrypted: boolean;
  aead: number;
  cipher: WebCipher | undefined;
  hubKey: string;
}

export class WebHandshake {
  private challenge: Uint8Array | undefined;
  private hello: Uint8Array | undefined;
  private hubKx: Uint8Array = new Uint8Array(0);
  private hubKey = "";

  private constructor(
    private readonly info: HelloFacts,
    private readonly wallet: WebWallet,
    private readonly opts: HandshakeOptions,
    private readonly kx: WebKeyExchange,
  ) {}

  static async create(info: HelloFacts, wallet: WebWallet, opts: HandshakeOptions): Promise<WebHandshake> {
    checkAeadsOffered(opts.aeads);
    return new WebHandshake(info, wallet, opts, await WebKeyExchange.create(opts.kxPrivate));
  }

  /** The SessionHello's bytes for the challenge `data`; ProtocolError with the close code to use. */
  async receiveChallenge(data: Uint8Array): Promise<Uint8Array> {
    if (this.challenge) throw new Error("receiveChallenge called twice");
    const ch: SessionChallenge = parseChallenge(data, this.opts);
    this.hubKey = ch.hubKey;
    this.hubKx = ch.kxPublic;
    const body = helloBody(this.info, this.wallet.address, ch, this.kx.publicKey, this.opts);
    const signature = await this.wallet.sign(helloSignedMessage(body));
    this.challenge = data;
    this.hello = helloMessage(body, signature);
    return this.hello;
  }

  /** Check the SessionAccept `data`; ProtocolError with the close code to use. */
  async receiveAccept(data: Uint8Array): Promise<WebAccepted> {
    if (!this.challenge || !this.hello) throw new Error("receiveAccept before receiveChallenge");
    const { msg, aead } = parseAccept(data);
    const transcript = await sha256(transcriptMessage(this.challenge, this.hello));
    const signed = acceptSignedMessage(transcript, msg.sessionId, msg.encrypted, aead);
    if (!(await ed25519Verify(this.hubKey, signed, msg.signature))) throw badSignature(this.hubKey);
    const bad = badAccept(msg, aead, this.opts, this.hubKx);
    if (bad) throw bad;
    let cipher: WebCipher | undefined;
    if (msg.encrypted) {
      if (aead !== AEAD_AES_256_GCM) {
        // The hub chose ChaCha20-Poly1305 although only AES-256-GCM was offered (an old hub).
        const why = "accept: ChaCha20-Poly1305, which a browser cannot seal; this worker offers AES-256-GCM only";
        throw new ProtocolError(CloseCode.E2E_MISMATCH, why);
      }
      const shared = await this.kx.sharedSecret(this.hubKx);
      cipher = await WebCipher.forWorker(await deriveTunnelKeys(shared, transcript, aead));
    }
    return { sessionId: msg.sessionId, encrypted: msg.encrypted, aead, cipher, hubKey: this.hubKey };
  }
}
