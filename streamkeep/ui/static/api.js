// Talking to the server: fetch with the token, errors worth showing, SSE over fetch streaming,
// and how stream content is turned into text. Every page imports from here.

const TOKEN_KEY = "streamkeep.token";

// The token lives in this tab's sessionStorage only: never in a URL, a cookie or localStorage.
// Stream content cannot reach it: streams are served with `Content-Security-Policy: sandbox`
// (an opaque origin, no script), and this UI renders their bytes as text, never as HTML.
export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

export class HttpError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

// `/v1/stream/a/b c` for the stream `a/b c`: each path segment percent-encoded.
export function encodeName(name) {
  return name.split("/").map(encodeURIComponent).join("/");
}

export function streamPath(name) {
  return "/v1/stream/" + encodeName(name);
}

export function adminPath(name) {
  return name === undefined ? "/v1/admin/streams" : "/v1/admin/streams/" + encodeName(name);
}

// fetch() with the bearer token; any status outside 2xx/304 becomes an HttpError carrying the
// server's JSON error code and message.
export async function request(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const bearer = token();
  if (bearer) headers.set("Authorization", "Bearer " + bearer);
  const response = await fetch(path, { ...options, headers, cache: "no-store" });
  if (response.ok || response.status === 304) return response;
  let code = "", message = response.statusText;
  try {
    const body = await response.json();
    code = body.error?.code || "";
    message = body.error?.message || message;
  } catch {
    // not JSON: keep the status text
  }
  throw new HttpError(response.status, code, message);
}

export async function getJSON(path, options = {}) {
  return (await request(path, options)).json();
}

// One line for a person: what went wrong and what to do about it.
export function describe(error) {
  if (error instanceof HttpError) {
    if (error.status === 401) {
      return `401 Unauthorized (${error.code || "no token"}): this server needs a token. ` +
        "Paste a bearer token in the field at the top; it is kept in this tab only.";
    }
    if (error.status === 403) {
      return `403 Forbidden: this token does not grant that (${error.message}).`;
    }
    return `${error.status} ${error.code}: ${error.message}`;
  }
  if (error?.name === "AbortError") return "stopped";
  return `the server did not answer (${error?.message || error})`;
}

// Globs as subscriptions and scopes use them (protocol/globs.py, the same steps): `*` is one
// path segment, `**` any number of them, and `*` inside a segment matches within it. A pattern
// with neither `*` nor `/` matches as a substring, for quick typing.
export function globMatcher(pattern) {
  pattern = pattern.trim();
  if (!pattern) return () => true;
  if (!/[*/]/.test(pattern)) return (name) => name.includes(pattern);
  const segments = [];
  for (const segment of pattern.split("/")) {
    if (!(segment === "**" && segments.at(-1) === "**")) segments.push(segment);
  }
  const escape = (text) => text.replace(/[.+?^${}()|[\]\\]/g, "\\$&");
  const tests = segments.map((segment) => {
    if (segment === "**" || segment === "*") return () => segment === "*";
    if (!segment.includes("*")) return (part) => part === segment;
    const regex = new RegExp("^" + segment.split("*").map(escape).join(".*") + "$");
    return (part) => regex.test(part);
  });
  // A `**` may match nothing: standing at it also means standing at the next segment.
  const close = (states) => {
    for (let i = 0; i < segments.length; i++) if (states.has(i) && segments[i] === "**") states.add(i + 1);
    return states;
  };
  return (name) => {
    let states = close(new Set([0]));
    for (const part of name.split("/")) {
      const next = new Set();
      for (const i of states) {
        if (segments[i] === "**") next.add(i);
        else if (i < segments.length && tests[i](part)) next.add(i + 1);
      }
      states = close(next);
      if (!states.size) return false;
    }
    return states.has(segments.length);
  };
}

// Server-Sent Events over fetch (EventSource cannot send the Authorization header, and the
// token must not go in the URL). Yields {event, data} until the server ends the response.
export async function* sseEvents(path, signal) {
  const response = await request(path, { signal, headers: { Accept: "text/event-stream" } });
  const base64 = response.headers.get("Stream-SSE-Data-Encoding") === "base64";
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let text = colon < 0 ? "" : line.slice(colon + 1);
          if (text.startsWith(" ")) text = text.slice(1);
          if (field === "event") event = text;
          else if (field === "data") data.push(text);
        }
        yield { event, data: data.join("\n"), base64 };
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// Follows a stream live from `offset`, reconnecting where it left off when the server ends an
// SSE response (it does every --sse-close-after seconds). Calls onData(payload, base64, offset)
// per data event and onState(text) as the connection changes; resolves when the stream is closed
// or `signal` aborts, and throws an HttpError the server answered (404 deleted, 401, ...).
export async function follow(name, offset, { signal, onData, onState = () => {} }) {
  let failures = 0;
  while (!signal.aborted) {
    try {
      onState("connecting");
      const path = `${streamPath(name)}?offset=${encodeURIComponent(offset)}&live=sse`;
      for await (const message of sseEvents(path, signal)) {
        failures = 0;
        if (message.event === "data") {
          onData(message.data, message.base64, offset);
        } else if (message.event === "control") {
          const control = JSON.parse(message.data);
          offset = control.streamNextOffset || offset;
          if (control.streamClosed) {
            onState("closed");
            return offset;
          }
          onState("live");
        }
      }
    } catch (error) {
      if (signal.aborted) break;
      if (error instanceof HttpError) throw error;
      failures += 1; // the network or the server went away: retry, backing off to 5 s
      onState("reconnecting");
      await sleep(Math.min(5000, 250 * 2 ** failures), signal);
    }
  }
  return offset;
}

export function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

// ---- content as text ------------------------------------------------------------------------

function mediaType(contentType) {
  return (contentType || "").split(";")[0].trim().toLowerCase();
}

export function isJSON(contentType) {
  return mediaType(contentType) === "application/json";
}

// As the server decides it (protocol/headers.py is_text): text/* and JSON; the rest is bytes.
export function isText(contentType) {
  const type = mediaType(contentType);
  return type.startsWith("text/") || type === "application/json";
}

export function base64Bytes(text) {
  const raw = atob(text.replace(/\s+/g, ""));
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

// A hex dump: offset, 16 bytes, their printable ASCII. Long payloads are cut at `limit` bytes.
export function hexDump(bytes, limit = 4096) {
  const lines = [];
  const shown = Math.min(bytes.length, limit);
  for (let at = 0; at < shown; at += 16) {
    const row = bytes.subarray(at, Math.min(at + 16, shown));
    const hex = Array.from(row, (b) => b.toString(16).padStart(2, "0")).join(" ");
    const ascii = Array.from(row, (b) => (b >= 0x20 && b < 0x7f ? String.fromCharCode(b) : ".")).join("");
    lines.push(`${at.toString(16).padStart(8, "0")}  ${hex.padEnd(47)}  |${ascii}|`);
  }
  if (bytes.length > shown) lines.push(`... ${bytes.length - shown} more bytes`);
  return lines.join("\n");
}

// The entries to show for one payload: JSON messages pretty-printed one by one, text as text,
// bytes as hex. `payload` is a string (JSON array or text) or a Uint8Array.
export function renderPayload(contentType, payload) {
  if (payload instanceof Uint8Array) return [hexDump(payload)];
  if (isJSON(contentType)) {
    try {
      const messages = JSON.parse(payload);
      return (Array.isArray(messages) ? messages : [messages]).map((m) => JSON.stringify(m, null, 2));
    } catch {
      return [payload];
    }
  }
  return [payload];
}

export function hexToBytes(text) {
  const clean = text.replace(/\s+/g, "");
  if (clean.length % 2 || /[^0-9a-f]/i.test(clean)) throw new Error("hex needs pairs of 0-9a-f");
  return Uint8Array.from(clean.match(/../g) || [], (pair) => parseInt(pair, 16));
}

// ---- small formatting helpers -----------------------------------------------------------------

export function formatBytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

export function formatTime(ms) {
  return ms ? new Date(ms).toLocaleString() : "";
}

// document.createElement with properties and children, so pages build DOM without innerHTML.
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key in node) node[key] = value;
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined && child !== false) {
      node.append(child instanceof Node ? child : String(child));
    }
  }
  return node;
}
