// Stands in for @durable-streams/server's DurableStreamTestServer when the client conformance
// runner targets streamkeep: start() opens a proxy to the streamkeep server at $STREAMKEEP_URL
// (started and stopped by ops/client_conformance/__main__.py) and gives the runner the proxy's
// URL. The proxy serves the test-control endpoint the runner's fault-injection cases use
// (POST/DELETE /_test/inject-error) with the reference server's semantics (0.3.7,
// DurableStreamTestServer.consumeInjectedFault and friends): per path, optionally per method and
// with a probability, `count` times: a delay (+ jitter), a dropped connection, an error status
// (with Retry-After), a truncated or corrupted body, or an SSE event written before the server's.
// Everything else is forwarded to streamkeep, a stream's path put under /v1/stream (the suite's
// streams are /test-stream-<uuid>, at the root as on the reference server; streamkeep serves
// streams under /v1/stream/ only).
import http from "node:http"

const STREAM_PREFIX = `/v1/stream`

const HOP_BY_HOP = new Set([
  `connection`,
  `keep-alive`,
  `proxy-connection`,
  `transfer-encoding`,
  `upgrade`,
  `te`,
  `trailer`,
])

export class DurableStreamTestServer {
  constructor(options = {}) {
    this.options = options
    this.faults = new Map()
    this.server = null
    this._url = null
    const target = process.env.STREAMKEEP_URL
    if (!target) throw new Error(`STREAMKEEP_URL is not set: run through ops/client_conformance`)
    this.target = new URL(target)
    this.agent = new http.Agent({ keepAlive: true, maxSockets: 64 })
    this.sockets = new Set()
  }

  get url() {
    if (!this._url) throw new Error(`Server not started`)
    return this._url
  }

  async start() {
    this.server = http.createServer((req, res) => {
      this.handle(req, res).catch((err) => {
        console.error(`[streamkeep proxy]`, err)
        if (!res.headersSent) res.writeHead(502, { "content-type": `text/plain` })
        res.end()
      })
    })
    this.server.on(`connection`, (socket) => {
      this.sockets.add(socket)
      socket.on(`close`, () => this.sockets.delete(socket))
    })
    await new Promise((resolve) =>
      this.server.listen(this.options.port ?? 0, `127.0.0.1`, resolve)
    )
    const { port } = this.server.address()
    this._url = `http://127.0.0.1:${port}`
    console.log(`streamkeep at ${this.target.origin} behind the fault-injecting proxy ${this._url}`)
    return this._url
  }

  async stop() {
    for (const socket of this.sockets) socket.destroy()
    this.agent.destroy()
    if (this.server) await new Promise((resolve) => this.server.close(() => resolve()))
    this.server = null
  }

  consume(path, method) {
    const fault = this.faults.get(path)
    if (!fault) return null
    if (fault.method && fault.method.toUpperCase() !== method.toUpperCase()) return null
    if (fault.probability !== undefined && Math.random() > fault.probability) return null
    fault.count--
    if (fault.count <= 0) this.faults.delete(path)
    return fault
  }

  async control(req, res) {
    if (req.method === `DELETE`) {
      this.faults.clear()
      res.writeHead(200, { "content-type": `application/json` })
      res.end(`{"ok":true}`)
      return
    }
    if (req.method !== `POST`) {
      res.writeHead(405)
      res.end()
      return
    }
    let config
    try {
      config = JSON.parse(Buffer.concat(await collect(req)).toString())
    } catch {
      res.writeHead(400)
      res.end(`Invalid JSON body`)
      return
    }
    const known =
      config.status !== undefined ||
      config.delayMs !== undefined ||
      config.dropConnection ||
      config.truncateBodyBytes !== undefined ||
      config.corruptBody ||
      config.injectSseEvent !== undefined
    if (!config.path || !known) {
      res.writeHead(400)
      res.end(`Missing path or fault type`)
      return
    }
    const { path, ...fault } = config
    this.faults.set(path, { ...fault, count: config.count ?? 1 })
    res.writeHead(200, { "content-type": `application/json` })
    res.end(`{"ok":true}`)
  }

  async handle(req, res) {
    const path = new URL(req.url ?? `/`, `http://proxy`).pathname
    if (path === `/_test/inject-error`) return this.control(req, res)
    const fault = this.consume(path, req.method ?? `GET`)
    if (fault) {
      if (fault.delayMs > 0) {
        const jitter = fault.jitterMs ? Math.random() * fault.jitterMs : 0
        await new Promise((resolve) => setTimeout(resolve, fault.delayMs + jitter))
      }
      if (fault.dropConnection) {
        req.socket.destroy()
        return
      }
      if (fault.status !== undefined) {
        const headers = { "content-type": `text/plain` }
        if (fault.retryAfter !== undefined) headers[`retry-after`] = String(fault.retryAfter)
        res.writeHead(fault.status, headers)
        res.end(`Injected error for testing`)
        return
      }
    }
    const headers = {}
    for (const [name, value] of Object.entries(req.headers)) {
      if (!HOP_BY_HOP.has(name.toLowerCase())) headers[name] = value
    }
    headers.host = this.target.host
    const rewrites = fault && (fault.truncateBodyBytes !== undefined || fault.corruptBody)
    if (rewrites) delete headers[`accept-encoding`] // the fault is on the bytes the client parses
    const upstream = http.request({
      host: this.target.hostname,
      port: this.target.port,
      method: req.method,
      path: req.url.startsWith(`/v1/`) ? req.url : STREAM_PREFIX + req.url,
      headers,
      agent: this.agent,
    })
    res.on(`close`, () => upstream.destroy())
    upstream.on(`error`, () => {
      if (!res.headersSent) res.writeHead(502)
      res.end()
    })
    upstream.on(`response`, async (answer) => {
      const out = {}
      for (const [name, value] of Object.entries(answer.headers)) {
        if (!HOP_BY_HOP.has(name.toLowerCase())) out[name] = value
      }
      const sse = String(answer.headers[`content-type`] ?? ``).startsWith(`text/event-stream`)
      if (fault?.injectSseEvent && sse) {
        res.writeHead(answer.statusCode, out)
        res.write(`event: ${fault.injectSseEvent.eventType}\n`)
        res.write(`data: ${fault.injectSseEvent.data}\n\n`)
        answer.pipe(res)
        return
      }
      if (rewrites && !sse) {
        let body = Buffer.concat(await collect(answer))
        if (fault.truncateBodyBytes !== undefined && body.length > fault.truncateBodyBytes) {
          body = body.subarray(0, fault.truncateBodyBytes)
        }
        if (fault.corruptBody && body.length > 0) {
          body = Buffer.from(body)
          body[0] = 88
          if (body.length > 1) body[1] = 89
          const corrupt = Math.max(1, Math.floor(body.length * 0.1))
          for (let i = 0; i < corrupt; i++) body[Math.floor(Math.random() * body.length)] = 90
        }
        out[`content-length`] = String(body.length)
        res.writeHead(answer.statusCode, out)
        res.end(body)
        return
      }
      res.writeHead(answer.statusCode, out)
      answer.pipe(res)
    })
    req.pipe(upstream)
  }
}

async function collect(stream) {
  const parts = []
  for await (const part of stream) parts.push(part)
  return parts
}
