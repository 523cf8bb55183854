"""The contract between a worker and the service: pydantic models (REST, OpenAPI), the msgspec
structs derived from them, a step as columns of arrays, the operation table, the wire errors,
addresses, the shared-memory handles, and what a KV-aware router agrees on (`routing`).
Imports neither `server.service` nor `server.transport`."""
