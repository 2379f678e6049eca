"""The worker side: block pool, KV event and load publishers, engines and their HTTP server."""
