"""The gateway: HTTP front door, worker registry, routing policies and the `kvgate` CLI."""
