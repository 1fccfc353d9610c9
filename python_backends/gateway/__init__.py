"""The gateway: one HTTP front door (OpenAI's API, Triton's generate endpoints) for many
Triton servers serving this repository. docs/gateway.md."""
