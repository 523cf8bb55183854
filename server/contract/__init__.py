"""The contract between a worker and the service: pydantic models (REST, OpenAPI), the msgspec
structs derived from them, a step as columns of arrays, the operation table, the wire errors,
addresses and the shared-memory handles. Imports neither `server.service` nor
`server.transport`."""
