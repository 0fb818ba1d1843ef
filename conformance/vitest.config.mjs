import { defineConfig } from "vitest/config"

export default defineConfig({
  test: {
    include: ["conformance.test.mjs"],
    testTimeout: 30000,
    hookTimeout: 30000,
    reporters: process.env.CONFORMANCE_REPORTER ? [process.env.CONFORMANCE_REPORTER] : ["default"],
  },
})
