"""Testing support (not used by the runtime): a real sglang server with a tiny dummy-weight
model on the CPU or a GPU, for the end-to-end tests and the demo."""
