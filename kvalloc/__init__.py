"""kvalloc: a KV-cache block allocator for LLM inference with speculative decoding.

The distribution's one importable name. Its packages are the repository's rooms, which the build
maps here (pyproject.toml's ``package-dir``): `kvalloc.allocator` (the library: capacity
accounting, block tables, NWOR), `kvalloc.server` (the service, its contract and transports, the
client) and `kvalloc.worker` (the reference inference worker). Nothing is imported here: a
program loads the rooms it names.
"""
