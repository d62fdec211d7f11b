"""Model files the project ships with or converts (the bundled SmolLM2 default)."""
