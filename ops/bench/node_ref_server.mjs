// Starts the upstream Node reference server: memory, or file-backed (LMDB + logs, fsync per append)
// when DATA_DIR is set. Prints the same "listening on" line as streamkeep for ops/serverproc.py.
import { DurableStreamTestServer } from "@durable-streams/server"

const server = new DurableStreamTestServer({
  port: Number(process.env.PORT ?? 0),
  host: "127.0.0.1",
  dataDir: process.env.DATA_DIR || undefined,
  compression: false,
})
const url = await server.start()
console.log(`streamkeep listening on ${url}`)
const stop = async () => { await server.stop(); process.exit(0) }
process.on("SIGTERM", stop)
process.on("SIGINT", stop)
