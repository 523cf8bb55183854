"""The transports in front of the core: REST (FastAPI), ZeroMQ IPC, the stream socket, the network
limits they share, when they poll for the next call, and the token files beside endpoints."""
