"""The service's KV events on ZeroMQ: one stream for the service or one per engine (worker),
open to routers by the operating system's file modes or by an events-only credential, never by
the token workers hold."""
