"""The demo's server harness (not used by the runtime): a real sglang server with a tiny
dummy-weight model on the CPU or a GPU; the test suites' own support lives in the test
tree."""
