// The State Protocol's reference materializer (@durable-streams/state's MaterializedState), run on
// a JSON array of stream messages from the file named first: prints the state as
// {"type": {"key": value}}, keys sorted. Control messages are application logic to that class;
// like its StreamDB, `reset` clears the state here and snapshot boundaries change nothing.
import { readFileSync } from "node:fs"
import { MaterializedState, isChangeEvent, isControlEvent } from "@durable-streams/state"

const messages = JSON.parse(readFileSync(process.argv[2], "utf8"))
const state = new MaterializedState()
for (const message of messages) {
  if (isChangeEvent(message)) state.apply(message)
  else if (isControlEvent(message) && message.headers.control === "reset") state.clear()
}
const out = {}
for (const type of [...state.types].sort()) {
  const entries = [...state.getType(type).entries()].sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0))
  if (entries.length) out[type] = Object.fromEntries(entries)
}
process.stdout.write(JSON.stringify(out))
