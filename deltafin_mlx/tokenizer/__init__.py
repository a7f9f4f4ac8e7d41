"""Text to token ids and back, as the model's config names them: Kimi's tiktoken, K3's
XTML and Jinja templates (sandboxed), and the checks on what a conversation may hold."""
