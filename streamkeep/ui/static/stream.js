// One stream's page (#/stream/<name>): its metadata, producers, forks and subscriptions (from
// GET /v1/admin/streams/<name>, polled every second, which also feeds the chart of appends/s and
// live readers), a live tail over SSE, reading back from any offset, an append box, and delete.

import {
  HttpError, adminPath, base64Bytes, describe, el, follow, formatBytes, formatTime, getJSON,
  hexToBytes, isJSON, isText, renderPayload, request, streamPath,
} from "./api.js";
import { makeChart } from "./chart.js";

const DETAILS_MS = 1000;
const TAIL_KEEP = 500; // entries the live tail keeps; older ones scroll away
const READ_SHOWN = 200; // messages one read back shows

export function render(main, name) {
  const controller = new AbortController();
  const signal = controller.signal;
  let info = null;
  let previous = null; // the last sample, for appends/s

  const error = el("div", { className: "error", id: "stream-error", role: "alert", hidden: true });
  const meta = el("dl", { className: "meta", id: "meta" });
  const producers = el("tbody", { id: "producers" });
  const forks = el("ul", { id: "forks" });
  const subscriptions = el("tbody", { id: "subscriptions" });
  const chartBox = el("div", { className: "chart-box", id: "chart" });
  const chart = makeChart(chartBox, [
    { label: "appends/s", format: (v) => v.toFixed(v < 10 ? 1 : 0) },
    { label: "live readers", format: (v) => String(Math.round(v)) },
  ]);

  // ---- live tail ----
  const tailState = el("span", { className: "badge", id: "tail-state" }, "connecting");
  const tail = el("ol", { className: "messages", id: "tail" });
  const clearTail = el("button", { type: "button", onclick: () => tail.replaceChildren() }, "Clear");

  // ---- read back ----
  const readOffset = el("input", { id: "read-offset", value: "-1", spellcheck: false,
    title: "-1 for the start, now for the tail, or an offset token" });
  const readResult = el("ol", { className: "messages", id: "read-result" });
  const readNote = el("span", { className: "muted", id: "read-note" });
  const readNext = el("button", { type: "button", id: "read-next", hidden: true,
    onclick: () => readBack(readNext.dataset.offset) }, "Read on");

  // ---- append ----
  const appendBody = el("textarea", { id: "append-body", rows: 4, spellcheck: false });
  const appendHex = el("input", { type: "checkbox", id: "append-hex" });
  const hexLabel = el("label", { hidden: true }, appendHex, " hex bytes");
  const appendResult = el("span", { className: "muted", id: "append-result" });

  // ---- delete ----
  const confirmBox = el("span", { id: "delete-confirm-box", hidden: true },
    `Delete ${name} and all its data? `,
    el("button", { type: "button", id: "delete-confirm", className: "danger", onclick: remove }, "Yes, delete"),
    " ",
    el("button", { type: "button", onclick: () => { confirmBox.hidden = true; } }, "Cancel"));

  main.append(
    el("p", {}, el("a", { href: "#/" }, "← all streams")),
    el("h1", { id: "stream-name" }, name),
    error,
    el("div", { className: "columns" },
      el("section", {}, el("h2", {}, "Metadata"), meta),
      el("section", {}, el("h2", {}, "Activity"), chartBox)),
    el("div", { className: "columns" },
      el("section", {}, el("h2", {}, "Producers"),
        el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "id"), el("th", {}, "epoch"),
          el("th", {}, "last seq"))), producers)),
      el("section", {}, el("h2", {}, "Forks"), forks)),
    el("section", {}, el("h2", {}, "Subscriptions"),
      el("table", {}, el("thead", {}, el("tr", {},
        ["id", "type", "pattern", "status", "link", "acked offset", "pending"].map((t) => el("th", {}, t)))),
      subscriptions)),
    el("section", {}, el("h2", {}, "Live tail ", tailState, " ", clearTail), tail),
    el("section", {}, el("h2", {}, "Read back"),
      el("form", { className: "inline", onsubmit: (event) => { event.preventDefault(); readBack(readOffset.value); } },
        el("label", {}, "from offset ", readOffset), " ", el("button", { type: "submit", id: "read" }, "Read"),
        " ", readNext, " ", readNote),
      readResult),
    el("section", {}, el("h2", {}, "Append"),
      el("form", { className: "append", onsubmit: (event) => { event.preventDefault(); append(); } },
        appendBody, el("div", {}, el("button", { type: "submit", id: "append" }, "Append"), " ",
          hexLabel, " ", appendResult))),
    el("section", {}, el("h2", {}, "Delete"),
      el("button", { type: "button", id: "delete", className: "danger",
        onclick: () => { confirmBox.hidden = false; } }, "Delete stream ..."), " ", confirmBox),
  );

  function showError(failure) {
    error.hidden = failure === null;
    error.textContent = failure === null ? "" : describe(failure);
  }

  // ---- details, polled ----

  function drawDetails() {
    const state = info.deleted ? "deleted (kept while forks read it; 410 to readers)"
      : info.expired ? "expired (removed at the next sweep)" : info.closed ? "closed" : "open";
    const rows = [
      ["Content type", info.content_type],
      ["Created", formatTime(info.created_at)],
      ["State", state],
      ["Next offset", info.next_offset],
      ["Earliest offset", info.earliest_offset],
      ["Size", `${formatBytes(info.size)} (${info.size} bytes)`],
      ["Hot / cold", `${formatBytes(info.hot_bytes)} / ${formatBytes(info.cold_bytes)}`],
      ["Appends", info.appends],
      ["Live readers", info.live_readers],
      ["Stream id", info.stream_id],
    ];
    if (info.segments !== null) rows.push(["Segments", info.segments]);
    if (info.ttl_seconds !== null) rows.push(["TTL", `${info.ttl_seconds} s (sliding)`]);
    if (info.expires_at !== null) rows.push(["Expires at", info.expires_at]);
    if (info.last_stream_seq !== null) rows.push(["Last Stream-Seq", info.last_stream_seq]);
    if (info.read_only !== null) rows.push(["Read-only", info.read_only]);
    meta.replaceChildren(...rows.flatMap(([key, value]) => [el("dt", {}, key), el("dd", {}, value)]));
    if (info.forked_from) {
      meta.append(el("dt", {}, "Forked from"), el("dd", {},
        el("a", { href: "#/stream/" + encodeURIComponent(info.forked_from) }, info.forked_from),
        ` at ${info.fork_base_offset}`));
    }
    const emptyRow = (columns, text) => el("tr", {}, el("td", { colSpan: columns, className: "muted" }, text));
    producers.replaceChildren(...info.producers.map((p) =>
      el("tr", {}, el("td", {}, p.id), el("td", { className: "num" }, p.epoch),
        el("td", { className: "num" }, p.last_seq))));
    if (!info.producers.length) producers.append(emptyRow(3, "no idempotent producer has written here"));
    if (info.producers_total > info.producers.length) {
      producers.append(emptyRow(3, `... and ${info.producers_total - info.producers.length} more`));
    }
    forks.replaceChildren(...info.forks.map((fork) =>
      el("li", {}, el("a", { href: "#/stream/" + encodeURIComponent(fork) }, fork))));
    if (!info.forks.length) forks.append(el("li", { className: "muted" }, "none"));
    subscriptions.replaceChildren(...info.subscriptions.map((s) =>
      el("tr", {}, el("td", {}, s.id), el("td", {}, s.type), el("td", {}, s.pattern || "(explicit)"),
        el("td", {}, s.status + (s.wake_in_flight ? ", wake in flight" : "")), el("td", {}, s.link_type),
        el("td", { className: "offset" }, s.acked_offset),
        el("td", { className: "num" }, s.pending_bytes === null ? "" : formatBytes(s.pending_bytes)))));
    if (!info.subscriptions.length) {
      subscriptions.append(emptyRow(7, "no subscription you can see follows this stream"));
    }
    const binary = !isText(info.content_type);
    hexLabel.hidden = !binary;
    appendBody.placeholder = isJSON(info.content_type) ? '{"a JSON value": 1} or [several, messages]'
      : binary ? "text (sent as UTF-8), or hex bytes with the box ticked" : "text";
  }

  async function loadDetails() {
    const now = performance.now();
    info = await getJSON(adminPath(name), { signal });
    if (previous) {
      const seconds = (now - previous.at) / 1000;
      chart.push([Math.max(0, info.appends - previous.appends) / seconds, info.live_readers]);
    }
    previous = { at: now, appends: info.appends };
    drawDetails();
    showError(null);
  }

  // ---- live tail ----

  // One entry per message; the first carries the offset the payload starts at (the server says
  // where a read or an event starts, not where each message in it does).
  function showPayload(target, entries, offset, keep) {
    entries.forEach((text, i) => {
      target.append(el("li", {}, i ? null : el("span", { className: "offset" }, offset), el("pre", {}, text)));
    });
    while (keep && target.childElementCount > keep) target.firstElementChild.remove();
  }

  async function runTail(offset) {
    try {
      await follow(name, offset, {
        signal,
        onData: (payload, base64, at) => {
          const body = base64 ? base64Bytes(payload) : payload;
          showPayload(tail, renderPayload(info.content_type, body), at, TAIL_KEEP);
          tail.scrollTop = tail.scrollHeight;
        },
        onState: (state) => { tailState.textContent = state; tailState.dataset.state = state; },
      });
    } catch (failure) {
      if (signal.aborted) return;
      tailState.textContent = failure instanceof HttpError && failure.status === 404 ? "stream deleted"
        : describe(failure);
      tailState.dataset.state = "ended";
    }
  }

  // ---- read back, append, delete ----

  async function readBack(offset) {
    readNote.textContent = "reading ...";
    try {
      const response = await request(`${streamPath(name)}?offset=${encodeURIComponent(offset.trim() || "-1")}`, { signal });
      const type = response.headers.get("Content-Type") || info.content_type;
      const body = isText(type) ? await response.text() : new Uint8Array(await response.arrayBuffer());
      const entries = body.length ? renderPayload(type, body) : [];
      readResult.replaceChildren();
      showPayload(readResult, entries.slice(0, READ_SHOWN), offset, 0);
      const next = response.headers.get("Stream-Next-Offset");
      const atEnd = response.headers.get("Stream-Up-To-Date") === "true";
      readNote.textContent = `${entries.length} message${entries.length === 1 ? "" : "s"}` +
        (entries.length > READ_SHOWN ? ` (first ${READ_SHOWN} shown)` : "") +
        `; next offset ${next}${atEnd ? " (the tail)" : ""}`;
      readNext.dataset.offset = next;
      readNext.hidden = atEnd;
      readOffset.value = offset;
    } catch (failure) {
      readNote.textContent = describe(failure);
    }
  }

  async function append() {
    appendResult.textContent = "appending ...";
    try {
      const body = appendHex.checked && !isText(info.content_type)
        ? hexToBytes(appendBody.value) : appendBody.value;
      const response = await request(streamPath(name), {
        method: "POST", body, signal, headers: { "Content-Type": info.content_type },
      });
      appendResult.textContent = `appended; next offset ${response.headers.get("Stream-Next-Offset")}`;
      appendBody.value = "";
    } catch (failure) {
      appendResult.textContent = describe(failure);
    }
  }

  async function remove() {
    try {
      await request(streamPath(name), { method: "DELETE", signal });
      location.hash = "#/";
    } catch (failure) {
      showError(failure);
      confirmBox.hidden = true;
    }
  }

  // ---- start ----

  (async () => {
    try {
      await loadDetails();
    } catch (failure) {
      if (signal.aborted) return;
      showError(failure);
      tailState.textContent = "not following";
      if (failure instanceof HttpError && failure.status === 404) {
        error.textContent = `There is no stream named ${name} (404). It may have been deleted.`;
      }
      return;
    }
    runTail(info.next_offset); // from the tail as the page found it: nothing appended since is missed
    const poller = setInterval(() => loadDetails().catch((failure) => {
      if (!signal.aborted) showError(failure);
    }), DETAILS_MS);
    signal.addEventListener("abort", () => clearInterval(poller));
  })();

  return () => controller.abort();
}
