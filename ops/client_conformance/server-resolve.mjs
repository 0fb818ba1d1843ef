// Module resolution hook (see server-hook.mjs): only the reference server's package is redirected.
const shim = new URL("./streamkeep_server.mjs", import.meta.url).href

export async function resolve(specifier, context, nextResolve) {
  if (specifier === "@durable-streams/server") {
    return { url: shim, shortCircuit: true }
  }
  return nextResolve(specifier, context)
}
