"""Shared KV state outside one process: the global prefill queue and KV block transfer."""
