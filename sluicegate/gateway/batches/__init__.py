"""The Batch API: OpenAI's files and batches, Anthropic's message batches, and the runner that
serves their lines as live requests of the batch's key (docs/batches.md)."""
