"""The PyTorch engine: sequences in, tokens out, over a paged KV cache."""
