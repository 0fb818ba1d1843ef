// Entry file for the official suite. The package's own CLI finds no tests under vitest 4.1
// (upstream issue #284), so vitest runs this file, which registers the suite against our server.
import { Agent, setGlobalDispatcher } from "undici"
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

const baseUrl = process.env.CONFORMANCE_TEST_URL
if (!baseUrl) throw new Error("set CONFORMANCE_TEST_URL (ops/run_conformance.py does)")

// Node's fetch speaks HTTP/2 only through a dispatcher that allows it; the test CA comes in
// through NODE_EXTRA_CA_CERTS.
const agent = new Agent({ allowH2: process.env.CONFORMANCE_HTTP2 === "1" })
const token = process.env.CONFORMANCE_AUTH_TOKEN
if (token) {
  // The suite has no option for credentials: with auth on, every request it makes carries this
  // (admin) token, unless it sets Authorization itself (the subscriptions' callback tokens).
  const withToken = (dispatch) => (options, handler) => {
    const headers = options.headers ?? {}
    const pairs = Array.isArray(headers) ? headers : Object.entries(headers)
    const named = (name) => pairs.some((pair, index) =>
      Array.isArray(headers) ? index % 2 === 0 && String(pair).toLowerCase() === name
        : String(pair[0]).toLowerCase() === name)
    if (named("authorization")) return dispatch(options, handler)
    const added = Array.isArray(headers)
      ? [...headers, "authorization", `Bearer ${token}`]
      : { ...headers, authorization: `Bearer ${token}` }
    return dispatch({ ...options, headers: added }, handler)
  }
  setGlobalDispatcher(agent.compose(withToken))
} else {
  setGlobalDispatcher(agent)
}

runConformanceTests({
  baseUrl,
  longPollTimeoutMs: Number(process.env.CONFORMANCE_LONG_POLL_MS ?? 500),
  subscriptions: process.env.CONFORMANCE_SUBSCRIPTIONS === "1",
})
