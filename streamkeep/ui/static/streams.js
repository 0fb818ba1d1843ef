// The stream list (#/): every stream the token may read, with its type, size, tiers, next offset
// and state, filtered by a name glob.
//
// Staying current: the server's `__registry__` stream (State Protocol messages, one insert per
// create and one delete per delete) is followed live, so creates and deletes show at once; the
// sizes and offsets come from the admin API (GET /v1/admin/streams), refreshed every few seconds.
// Without a registry (404: --no-registry, an older server; or no read grant on it), the list is
// polled instead.

import {
  HttpError, adminPath, describe, el, follow, formatBytes, formatTime, getJSON, globMatcher, request,
  sleep, streamPath,
} from "./api.js";

const REGISTRY = "__registry__";
const POLL_MS = 2000; // without the registry
const REFRESH_MS = 5000; // with it: sizes, offsets and states

export function render(main) {
  const controller = new AbortController();
  const signal = controller.signal;
  const rows = new Map(); // name -> the admin API's summary, or a stub from the registry
  // Registry events are numbered; a list refresh started before an event must not undo it (a
  // stream created just after the refresh was asked for, or deleted just before it answered).
  let events = 0;
  const touched = new Map(); // name -> {at: event number, op: "insert" | "delete"}
  let applied = -1; // the event number the newest list answer applied was asked at
  let pattern = "";
  let server = null;
  let total = 0;
  let truncated = false;

  const filter = el("input", {
    type: "search", id: "filter", placeholder: "filter by name: orders/*, logs/**, or any text",
    spellcheck: false, oninput: () => { pattern = filter.value; draw(); scheduleRefresh(); },
  });
  const mode = el("span", { className: "muted", id: "list-mode" }, "loading ...");
  const error = el("div", { className: "error", id: "list-error", role: "alert", hidden: true });
  const summary = el("p", { className: "muted", id: "server-summary" });
  const body = el("tbody");
  const table = el("table", { className: "streams", id: "streams" },
    el("thead", {}, el("tr", {},
      ["Name", "Type", "Size", "Hot / cold", "Next offset", "State", "Readers", "Created"]
        .map((title) => el("th", {}, title)))),
    body);
  main.append(
    el("section", { className: "toolbar" }, el("h1", {}, "Streams"), filter, mode),
    error, summary, table,
  );

  function draw() {
    const matches = globMatcher(pattern);
    const shown = [...rows.values()].filter((row) => matches(row.name))
      .sort((a, b) => a.name.localeCompare(b.name));
    body.replaceChildren(...shown.map(rowFor));
    if (!shown.length) {
      body.append(el("tr", {}, el("td", { colSpan: 8, className: "muted" },
        rows.size ? "no stream matches this filter" : "no streams yet")));
    }
    const parts = [`${shown.length} shown`];
    if (truncated) parts.push(`the first ${rows.size} of ${total} listed: narrow the filter`);
    if (server) {
      parts.push(`server: ${server.streams} streams, ${formatBytes(server.stored_bytes)} stored, ` +
        `${server.appends} appends since start, ${server.live_readers} live readers`);
    }
    summary.textContent = parts.join(" · ");
  }

  function showError(failure) {
    error.hidden = failure === null;
    error.textContent = failure === null ? "" : describe(failure);
  }

  async function refresh() {
    const asked = events;
    const query = new URLSearchParams();
    if (pattern.trim() && /[*/]/.test(pattern)) query.set("match", pattern.trim());
    const data = await getJSON(adminPath() + (String(query) ? "?" + query : ""), { signal });
    if (asked < applied) return; // a later refresh answered first: this one is older news
    applied = asked;
    const fresh = new Map();
    for (const row of data.streams) {
      const change = touched.get(row.name);
      if (!(change && change.at > asked && change.op === "delete")) fresh.set(row.name, row);
    }
    for (const [name, row] of rows) {
      const change = touched.get(name);
      if (!fresh.has(name) && change && change.at > asked && change.op === "insert") fresh.set(name, row);
    }
    rows.clear();
    for (const [name, row] of fresh) rows.set(name, row);
    for (const [name, change] of touched) {
      if (change.at <= asked) touched.delete(name); // this answer already includes it
    }
    server = data.server || null;
    total = data.total;
    truncated = data.truncated;
    showError(null);
    draw();
  }

  let refreshTimer = null;
  function scheduleRefresh() { // after typing stops: the server filters too, past 1,000 streams
    clearTimeout(refreshTimer);
    refreshTimer = setTimeout(() => refresh().catch(() => {}), 300);
  }

  async function fill(name) { // a stream the registry announced: its details
    try {
      const row = await getJSON(adminPath(name), { signal });
      if (rows.has(name)) { rows.set(name, row); draw(); }
    } catch (failure) {
      // Gone again already (404), or a stream this token may not read (403): not listed.
      if (failure instanceof HttpError && [403, 404].includes(failure.status) && rows.get(name)?.stub) {
        rows.delete(name);
        draw();
      }
    }
  }

  function apply(message) {
    if (message?.type !== "stream" || typeof message.key !== "string") {
      if (message?.headers?.control === "reset") refresh().catch(() => {});
      return;
    }
    const name = message.key;
    const op = message.headers?.operation === "delete" ? "delete" : "insert";
    touched.set(name, { at: ++events, op });
    if (op === "delete") {
      rows.delete(name);
    } else {
      const value = message.value || {};
      if (!rows.has(name)) {
        rows.set(name, { name, content_type: value.contentType, created_at: value.createdAt, stub: true });
      }
      fill(name);
    }
    draw();
  }

  async function poll() {
    mode.textContent = `polling every ${POLL_MS / 1000} s (no ${REGISTRY} stream to follow)`;
    while (!signal.aborted) {
      try { await refresh(); } catch (failure) { if (!signal.aborted) fail(failure); }
      await sleep(POLL_MS, signal);
    }
  }

  function fail(failure) {
    showError(failure);
    if (failure instanceof HttpError && (failure.status === 401 || failure.status === 403)) {
      rows.clear();
      server = null;
      draw();
    }
  }

  async function run() {
    for (;;) {
      // Where the registry ends now: everything after it is replayed onto the list read next.
      let offset;
      try {
        const head = await request(streamPath(REGISTRY), { method: "HEAD", signal });
        offset = head.headers.get("Stream-Next-Offset");
        await refresh();
      } catch {
        if (signal.aborted) return;
        return poll(); // no registry (404), not ours to read (403), or no token yet (401)
      }
      mode.textContent = `live from ${REGISTRY}`;
      const refresher = setInterval(() => refresh().catch((failure) => fail(failure)), REFRESH_MS);
      try {
        await follow(REGISTRY, offset, {
          signal,
          onData: (payload) => {
            for (const message of JSON.parse(payload)) apply(message);
          },
          onState: (state) => {
            mode.textContent = state === "live" ? `live from ${REGISTRY}` : `${REGISTRY}: ${state}`;
          },
        });
      } catch (failure) {
        // 410: compacted past where we were (we were away a while): start over from its tail.
        if (!signal.aborted && failure instanceof HttpError && failure.status === 410) continue;
      } finally {
        clearInterval(refresher);
      }
      if (!signal.aborted) poll(); // the registry went away: fall back
      return;
    }
  }

  draw();
  run();
  return () => { controller.abort(); clearTimeout(refreshTimer); };
}

function rowFor(row) {
  const state = row.stub ? "..." : row.deleted ? "deleted (forks read it)" : row.expired ? "expired"
    : row.closed ? "closed" : "open";
  return el("tr", { dataset: { name: row.name } },
    el("td", {}, el("a", { href: "#/stream/" + encodeURIComponent(row.name) }, row.name),
      row.forked_from ? el("span", { className: "muted" }, ` fork of ${row.forked_from}`) : null),
    el("td", {}, row.content_type || ""),
    el("td", { className: "num" }, row.stub ? "" : formatBytes(row.size)),
    el("td", { className: "num" },
      row.stub ? "" : `${formatBytes(row.hot_bytes)} / ${formatBytes(row.cold_bytes)}`),
    el("td", { className: "offset" }, row.next_offset || ""),
    el("td", { className: "state-" + state.split(" ")[0].replace("...", "pending") }, state),
    el("td", { className: "num" }, row.live_readers ?? ""),
    el("td", {}, formatTime(row.created_at)));
}
