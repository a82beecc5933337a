"""Request scheduling on an attention rank: requests, KV block allocation, per-step token plans."""
