// Entry file for the official suite. The package's own CLI finds no tests under vitest 4.1
// (upstream issue #284), so vitest runs this file, which registers the suite against our server.
import { Agent, setGlobalDispatcher } from "undici"
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

const baseUrl = process.env.CONFORMANCE_TEST_URL
if (!baseUrl) throw new Error("set CONFORMANCE_TEST_URL (ops/run_conformance.py does)")

if (process.env.CONFORMANCE_HTTP2 === "1") {
  // Node's fetch speaks HTTP/2 only through a dispatcher that allows it; the test CA comes in
  // through NODE_EXTRA_CA_CERTS.
  setGlobalDispatcher(new Agent({ allowH2: true }))
}

runConformanceTests({
  baseUrl,
  longPollTimeoutMs: Number(process.env.CONFORMANCE_LONG_POLL_MS ?? 500),
  subscriptions: process.env.CONFORMANCE_SUBSCRIPTIONS === "1",
})
