"""KV-canary runtime subsystem for SGLang (config, device state, pool patchers, runner)."""
