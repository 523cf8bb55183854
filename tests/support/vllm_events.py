"""vLLM's own KV event classes, as the vLLM release on PyPI ships them, without vLLM's
dependencies: ``make routers`` takes ``vllm/distributed/kv_events.py`` (and
``vllm/v1/core/kv_cache_utils.py``, for the hash type) out of the wheel, and `load` runs the
module with its four vLLM imports answered here. Those imports are plumbing (a logger, network
helpers, a config class for the publisher's factory) and one type alias, which `load` takes from
the shipped ``kv_cache_utils.py`` text, so the event structs and their decoders are vLLM's own.
"""

from __future__ import annotations

import os
import re
import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ROOT = Path(os.environ.get("KVALLOC_VLLM_EVENTS", REPO / ".venv" / "vllm-events"))
EVENTS = ROOT / "vllm" / "distributed" / "kv_events.py"
CACHE_UTILS = ROOT / "vllm" / "v1" / "core" / "kv_cache_utils.py"
_ALIAS = re.compile(r"^ExternalBlockHash: TypeAlias = (.+)$", re.M)


def _stub(name: str, **attributes: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


def load() -> types.ModuleType:
    """vLLM's ``vllm.distributed.kv_events`` module. The stand-in ``vllm`` modules leave
    ``sys.modules`` once it is loaded (nothing else in the process may take them for vLLM); the
    module itself stays, where msgspec looks up its classes' annotations."""
    if not EVENTS.is_file():
        raise FileNotFoundError(f"{EVENTS} is missing: run `make routers` (it takes vLLM's event "
                                "module out of the vllm wheel)")
    alias = _ALIAS.search(CACHE_UTILS.read_text())
    assert alias is not None, "vLLM's kv_cache_utils no longer defines ExternalBlockHash"
    assert alias.group(1) == "bytes | int", f"ExternalBlockHash is now {alias.group(1)}"
    before = set(sys.modules)
    try:
        return _load()
    finally:
        for name in set(sys.modules) - before - {"vllm.distributed.kv_events"}:
            del sys.modules[name]


def _load() -> types.ModuleType:
    for package in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core",
                    "vllm.distributed"):
        sys.modules.setdefault(package, types.ModuleType(package))
    _stub("vllm.config.kv_events", KVEventsConfig=object)
    _stub("vllm.logger", init_logger=lambda name: __import__("logging").getLogger(name))
    _stub("vllm.utils.network_utils", get_ip=None, get_tcp_uri=None,
          is_valid_ipv6_address=None, split_zmq_path=None)
    _stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    module = types.ModuleType("vllm.distributed.kv_events")
    module.__file__ = str(EVENTS)
    sys.modules[module.__name__] = module
    exec(compile(EVENTS.read_text(), str(EVENTS), "exec"), module.__dict__)
    return module
