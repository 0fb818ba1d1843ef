// Loaded with `node --import` when the suite runs against streamkeep (--server streamkeep): the
// runner's `import { DurableStreamTestServer } from "@durable-streams/server"` then gets
// streamkeep_server.mjs, a fault-injecting proxy in front of the streamkeep process at
// $STREAMKEEP_URL, instead of upstream's in-process reference server.
import { register } from "node:module"

register("./server-resolve.mjs", import.meta.url)
