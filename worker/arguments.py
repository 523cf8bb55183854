"""`kvalloc worker`'s flags, apart from the command so that ``--help`` imports no torch,
transformers or Triton (tens of seconds on a loaded machine); `worker.cli` runs the command."""

from __future__ import annotations

import argparse

DTYPE_NAMES = ("bfloat16", "float16", "float32")  # torch's names; `worker.model.DTYPES` maps them
# `allocator.config.SlackPolicy`'s values (a test checks they agree): that module imports torch.
SLACK_POLICIES = ("reclaim", "none", "unreclaimed")


def positive_seconds(text: str) -> float:
    """A duration in (0, inf] seconds (NaN refused). Not the allocator's `bounded`: importing
    any of `kvalloc.allocator` imports torch."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:  # NaN compares false
        raise argparse.ArgumentTypeError(f"{text} is not in (0, inf]")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model (one of)")
    which = model.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a local Llama / Mistral / Qwen2 / DeepSeek-V3 checkpoint "
                                       "directory (or a model id already in the local cache)")
    which.add_argument("--model-config", help="a config JSON (with model_type): random weights")
    model.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                       help="weights and KV (default float32: exactly generate's tokens)")
    model.add_argument("--device", default=None,
                       help="where the model runs; the pool must be there too (default cuda "
                            "when torch sees one, else cpu)")
    model.add_argument("--seed", type=int, default=0,
                       help="seed of the random weights and the oracle drafter (default 0)")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--prompts", required=True, help="JSON lines: {\"id\", \"token_ids\"}")
    gen.add_argument("--max-new-tokens", type=int, default=32,
                     help="tokens to generate per prompt, fewer at a stop token (default 32)")
    gen.add_argument("--draft-len", type=int, default=3,
                     help="drafts per step D, 0 for none (default 3)")
    gen.add_argument("--drafter", default="ngram",
                     help="ngram (prompt lookup) or oracle:RATE (the true continuation, each "
                          "token right with probability RATE) (default ngram)")
    svc = parser.add_argument_group("the service")
    svc.add_argument("--address", default=None,
                     help="stream:///path, ipc:///path, tcp://host:port, http://host:port or "
                          "unix:///path (default: $KVALLOC_ADDRESS, else the service's default "
                          "stream socket)")
    svc.add_argument("--worker-id", default=None,
                     help="the name this worker registers under, the same every run so that "
                          "its prompts find the blocks an earlier run cached (default "
                          "<host>-worker, <host>-worker-rank<K> with --data-parallel-rank; a "
                          "second worker at once needs its own)")
    svc.add_argument("--replace", action="store_true",
                     help="end a live session of the same worker id before registering (this "
                          "worker's previous run was killed: its requests are freed now, not "
                          "when its lease ends; its cached prefixes stay)")
    svc.add_argument("--timeout", type=positive_seconds, default=30.0,
                     help="seconds to wait for one reply (default 30)")
    svc.add_argument("--in-process", action="store_true",
                     help="run a service core in this process instead of calling one")
    svc.add_argument("--overlap", action="store_true",
                     help="run one step ahead of the host: the call for step k+1 and its launch "
                          "while the device runs step k; drafts (oracle only), verification and "
                          "the commit on the device")
    svc.add_argument("--own-commit", action="store_true",
                     help="register as an overlap worker (as --overlap does) but run in step: "
                          "the worker commits its accepted tokens on the device inside its step "
                          "and the service's call commits nothing (the lighter call)")
    svc.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                     help="run N processes, each holding its shard of the model's heads, "
                          "against a service of N shards (kvalloc serve --devices ... "
                          "--tensor-parallel N); not with --in-process (default 1)")
    svc.add_argument("--data-parallel-rank", type=int, default=None, metavar="K",
                     help="the data-parallel rank this worker is: a service of several ranks "
                          "serves it on rank K's pool (default: none, for a service of one)")
    svc.add_argument("--cuda-graphs", action="store_true",
                     help="replay decode steps as captured CUDA graphs (a CUDA pool; decodes "
                          "padded to --draft-len drafts through the padding grant, batches "
                          "grown to 1, 2, 4, 8 or a multiple of 8)")
    svc.add_argument("--validate", action="store_true",
                     help="count block-table entries each step addresses that hold no block "
                          "(table_violations; off by default)")
    pool = parser.add_argument_group("the in-process pool")
    pool.add_argument("--num-blocks", type=int, default=None,
                      help="default: room for every prompt at once")
    pool.add_argument("--tokens-per-block", type=int, default=16,
                      help="block size in tokens (default 16)")
    pool.add_argument("--max-batch-size", type=int, default=64,
                      help="requests running at once (default 64)")
    pool.add_argument("--max-step-tokens", type=int, default=2048,
                      help="tokens one step may schedule (default 2048)")
    pool.add_argument("--slack-policy", choices=SLACK_POLICIES, default="reclaim",
                      help="the in-process service's overlap slack; none and unreclaimed "
                           "reproduce the crashes kvalloc prevents (default reclaim)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
