"""The service: one core (lock, epoch, sessions, retries), the pool as the workers share it (its
exported tensors, each worker's staging and fences), the registry of workers and handles, the
step from call to reply, the NWOR commit, KV event publishing, settings and the service
metrics. Speaks the contract; never imports `server.transport`."""
