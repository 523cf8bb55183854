"""`kvalloc worker`: serve a transformers causal LM with its KV in kvalloc, prompts from a file.

    kvalloc worker --model-config cfg.json --prompts prompts.jsonl --max-new-tokens 32 \\
        --draft-len 3 --drafter ngram --in-process --json

prints each prompt's generated token ids, tokens/s, the draft acceptance rate and the share of
step wall time spent in the kvalloc call. Without ``--in-process`` it registers with a running
``kvalloc serve`` (``--address``, as `server.client.Client` takes it) and needs that pool to fit
the model (layers, KV heads, head size, dtype). ``--drafter oracle:RATE`` first runs the prompts
without speculation to learn the true continuation, then drafts it with each token right with
probability RATE; the figures are the speculative run's.

``--overlap`` runs the worker one step ahead of the host (it registers with ``overlap=True``):
drafts come from the device (``oracle:RATE`` only), and the worker commits its own tokens.
``--own-commit`` registers so too but runs in step: the worker commits its own tokens, and its
results come with the next call.

``--tensor-parallel N`` runs N processes against a ``kvalloc serve --devices ...
--tensor-parallel N``: rank r holds its shard of the model and maps shard r of the pool, and
rank 0 alone calls the service (`worker.shard_client`); on CUDA rank r runs on ``cuda:r``.

``prompts.jsonl``: one ``{"id": ..., "token_ids": [...]}`` per line, or ``{"id": ..., "text":
...}`` with ``--model`` pointing at a checkpoint that has a tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from kvalloc.allocator import PoolConfig
from kvalloc.allocator.commands.interrupt import StopRequest, sigint_stops
from kvalloc.server.client import Client, in_process_client
from kvalloc.server.contract.addresses import default_client_address
from kvalloc.server.contract.errors import RemoteError, ServiceUnreachable, TransportTimeout
from kvalloc.worker.arguments import add_arguments as add_arguments  # a command's two names
from kvalloc.worker.drafters import (
    DeviceOracleDrafter,
    Drafter,
    NgramDrafter,
    OracleDrafter,
    parse_drafter_spec,
)
from kvalloc.worker.engine import Engine
from kvalloc.worker.errors import (
    DeviceUnavailable,
    DrafterSpecError,
    EngineError,
    Interrupted,
    ModelLoadError,
    PromptFileError,
    RunStopped,
)
from kvalloc.worker.model import (
    DTYPES,
    config_from_file,
    load_model,
    pool_for_model,
    pool_window,
    random_model,
    sized_groups,
)
from kvalloc.worker.parallel.local_ranks import run_local_ranks
from kvalloc.worker.parallel.sharding import shard_model
from kvalloc.worker.requests import NamedPrompt
from kvalloc.worker.run_stats import RunStats
from kvalloc.worker.shard_client import ShardClient
from tqdm import tqdm


def read_prompts(path: str | Path, tokenizer: Any = None,
                 vocab_size: int | None = None) -> list[NamedPrompt]:
    """The prompts of a JSON-lines file; ``text`` lines need ``tokenizer``. With
    ``vocab_size``, every token id must be one of the model's (0 to ``vocab_size - 1``)."""
    prompts = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise PromptFileError(f"prompts: cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"prompts: {path} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{where}: not JSON ({exc})") from None
        if not isinstance(item, dict) or "id" not in item:
            raise PromptFileError(f"{where}: needs an object with an \"id\"")
        if "token_ids" in item:
            ids = item["token_ids"]
            if not (isinstance(ids, list) and ids and
                    all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
                raise PromptFileError(f"{where}: token_ids must be a non-empty list of ints")
        elif "text" in item:
            if tokenizer is None:
                raise PromptFileError(f"{where}: \"text\" needs --model with a tokenizer; "
                                      f"give token_ids instead")
            ids = tokenizer(item["text"])["input_ids"]
        else:
            raise PromptFileError(f"{where}: needs \"token_ids\" or \"text\"")
        _check_vocabulary(ids, vocab_size, where)
        prompts.append(NamedPrompt(str(item["id"]), ids))
    if not prompts:
        raise PromptFileError(f"prompts: {path} holds no prompt")
    return prompts


def _check_vocabulary(ids: list[int], vocab_size: int | None, where: str) -> None:
    """Every id indexes the model's embedding (and so fits the int64 it travels as)."""
    if vocab_size is None:
        return
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise PromptFileError(f"{where}: token_ids[{i}]: {token} is not a token of the "
                                  f"model (0 to {vocab_size - 1})")


def run(args: argparse.Namespace) -> int:
    args.worker_id = args.worker_id or default_worker_id(args.data_parallel_rank)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        # SIGTERM too (docker stop, Kubernetes): its default would leave an --in-process pool's
        # shared memory behind and the worker's blocks held until its lease ends.
        with sigint_stops((signal.SIGINT, signal.SIGTERM)) as stop:
            result = _run(args, stop)
    except Interrupted as exc:
        summary = {"interrupted": True, **exc.stats.as_dict()}
        print(json.dumps(summary) if args.json else _human_interrupted(summary))
        return stop.status
    except RemoteError as exc:
        if exc.code == "worker_id_in_use":
            print(f"kvalloc worker: worker id {args.worker_id!r} is in use by a running worker; "
                  f"give this one another with --worker-id (or, if that worker is gone, take "
                  f"its id with --replace)", file=sys.stderr)
            return 2
        print(f"kvalloc worker: {exc}", file=sys.stderr)
        return 2
    except (ModelLoadError, PromptFileError, DrafterSpecError, EngineError, ValueError) as exc:
        print(f"kvalloc worker: {exc}", file=sys.stderr)
        return 2
    except ServiceUnreachable as exc:
        print(f"kvalloc worker: {exc} (or run with --in-process)", file=sys.stderr)
        return 2
    except TransportTimeout as exc:
        print(f"kvalloc worker: no service answers at {args.address or default_client_address()}"
              f" ({exc}); start one with `kvalloc serve`, or use --in-process", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else _human(result))
    return 0


def default_worker_id(data_parallel_rank: int | None) -> str:
    """A worker id that stays the same from run to run: the service's prefix cache keeps each
    worker id's prompts in a namespace of its own, so a per-process id would never reuse them."""
    rank = "" if data_parallel_rank is None else f"-rank{data_parallel_rank}"
    return f"{socket.gethostname()}-worker{rank}"


def _run(args: argparse.Namespace, stop: StopRequest) -> dict[str, Any]:
    parse_drafter_spec(args.drafter)
    check_device(args.device)
    if args.tensor_parallel != 1:
        return _run_ranks(args, stop)
    model = _model(args)
    prompts = read_prompts(args.prompts, _tokenizer(args.model), model.config.vocab_size)
    if stop.requested:  # Ctrl-C while the model loaded: nothing registered, nothing ran
        raise Interrupted(RunStats())
    with _client(args, model, prompts) as client:
        return _serve(model, client, prompts, args, stop)


def _model(args: argparse.Namespace) -> Any:
    dtype = DTYPES[args.dtype]
    if args.model is not None:
        return load_model(args.model, dtype=dtype, device=args.device)
    return random_model(config_from_file(args.model_config), seed=args.seed, dtype=dtype,
                        device=args.device)


def _serve(model: Any, client: Client | ShardClient, prompts: Sequence[NamedPrompt],
           args: argparse.Namespace, stop: StopRequest) -> dict[str, Any]:
    """The prompts' outputs and the run's figures, through a registered ``client``."""
    name, rate = parse_drafter_spec(args.drafter)
    drafter: Drafter | DeviceOracleDrafter
    if name == "oracle":
        truth, _ = generate(model, client, prompts, args, None, 0, stop)
        oracle = DeviceOracleDrafter if args.overlap else OracleDrafter
        assert client.pool is not None
        drafter = oracle(truth, rate, vocab_size=model.config.vocab_size, seed=args.seed,
                         **({"device": client.pool.kv.device} if args.overlap else {}))
    else:
        drafter = NgramDrafter()
    outputs, stats = generate(model, client, prompts, args, drafter, args.draft_len, stop)
    return {"outputs": [{"id": p.req_id, "token_ids": outputs[p.req_id]} for p in prompts],
            **stats.as_dict()}


def _run_ranks(args: argparse.Namespace, stop: StopRequest) -> dict[str, Any]:
    """``--tensor-parallel N``: N local ranks of one process group; rank 0's result."""
    if args.tensor_parallel < 1 or args.in_process:
        raise EngineError(f"--tensor-parallel {args.tensor_parallel}: needs 1 or more ranks "
                          f"and a running kvalloc serve of as many shards (not --in-process)")
    on_cuda = torch.device(args.device).type == "cuda"
    result = run_local_ranks(_rank, args.tensor_parallel, vars(args),
                             backend="nccl" if on_cuda else "gloo", stop=stop)[0]
    if isinstance(result, RunStats):  # stopped at a step boundary, every rank deregistered
        raise Interrupted(result)
    return result


def _rank(rank: int, world: int, options: dict[str, Any],
          stop: Callable[[], bool]) -> dict[str, Any] | RunStats:
    """One rank of ``--tensor-parallel``: its model shard, its pool shard, the same prompts.
    Rank 0 reads ``stop`` before each step (the parent's Ctrl-C): then every rank ends at that
    step and rank 0 returns the figures so far."""
    args = argparse.Namespace(**options)
    if torch.device(args.device).type == "cuda":
        args.device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    args.no_progress = args.no_progress or rank != 0
    model = shard_model(_model(args), rank, world)
    prompts = read_prompts(args.prompts, _tokenizer(args.model), model.config.vocab_size)
    client = (Client(args.address, worker_id=args.worker_id, timeout_s=args.timeout)
              if rank == 0 else None)
    shards = ShardClient(rank, world, client, stop=stop if rank == 0 else None)
    shards.register(overlap=_commits_itself(args), data_parallel_rank=args.data_parallel_rank,
                    replace=args.replace)
    try:
        return _serve(model, shards, prompts, args, StopRequest())
    except Interrupted as exc:
        return exc.stats
    finally:
        shards.deregister()


def generate(model: Any, client: Client | ShardClient, prompts: Sequence[NamedPrompt],
             args: argparse.Namespace,
             drafter: Drafter | DeviceOracleDrafter | None, draft_len: int,
             stop: StopRequest) -> tuple[dict[str, list[int]], RunStats]:
    """Every prompt's output; `Interrupted` once ``stop`` is set, at the end of a step (its
    reply taken, no call in flight), so that the client can still deregister."""
    engine = Engine(model, client, drafter, draft_len=draft_len,
                    stop_token_ids=_stop_tokens(model), share_prefixes=True,
                    overlap=args.overlap,
                    validate=args.validate, cuda_graphs=args.cuda_graphs)
    total = len(prompts) * args.max_new_tokens

    def after_step(tokens: int) -> None:
        bar.update(tokens)
        if stop.requested:
            raise Interrupted(engine.stats)

    with tqdm(total=total, unit="tok", file=sys.stderr, disable=args.no_progress or None,
              desc="speculative" if draft_len else "plain") as bar:
        try:
            if next(model.parameters()).is_cuda:  # compile and capture first, not mid-run
                engine.warm_up()
            outputs = engine.run(prompts, args.max_new_tokens, on_progress=after_step)
        except RunStopped:  # a tensor-parallel rank: rank 0 stopped every rank at one step
            raise Interrupted(engine.stats) from None
    return outputs, engine.stats


def check_device(device: str) -> None:
    """`DeviceUnavailable` for a CUDA device torch cannot see, before anything is loaded."""
    try:
        where = torch.device(device)
    except RuntimeError as exc:
        raise DeviceUnavailable(f"--device {device}: {exc}") from None
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        seen = torch.cuda.device_count()
        raise DeviceUnavailable(f"--device {device}: torch sees {seen} CUDA device(s) here; "
                                f"use --device cpu")


def _stop_tokens(model: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _tokenizer(model: str | None) -> Any:
    if model is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError):
        return None  # a checkpoint without a tokenizer: token_ids prompts only


@contextlib.contextmanager
def _client(args: argparse.Namespace, model: Any,
            prompts: Sequence[NamedPrompt]) -> Iterator[Client]:
    """A registered, attached client: to ``--address``, or to a service made in this process."""
    if not args.in_process:
        with Client(args.address, worker_id=args.worker_id, timeout_s=args.timeout) as client:
            client.register(overlap=_commits_itself(args), own_table=args.overlap,
                            data_parallel_rank=args.data_parallel_rank, replace=args.replace)
            try:
                yield client
            finally:
                with contextlib.suppress(Exception):  # a lost service frees it by lease
                    client.deregister()
        return
    pool = in_process_pool(args, model, prompts)
    groups = sized_groups(model.config, pool, num_requests=len(prompts),
                          max_step_tokens=args.max_step_tokens)
    with in_process_client(pool, max_step_tokens=args.max_step_tokens,
                           worker_id=args.worker_id, groups=groups) as client:
        client.register(overlap=_commits_itself(args), own_table=args.overlap)
        yield client


def _commits_itself(args: argparse.Namespace) -> bool:
    """Whether the worker registers as an overlap worker, which commits its own tokens. Only
    one that runs ahead keeps its own block table (``own_table=args.overlap``): that spares the
    GPU the service's fence between two forwards, where in step the GPU waits for the call
    anyway, and the copy measured slower there."""
    return args.overlap or args.own_commit


def in_process_pool(args: argparse.Namespace, model: Any,
                    prompts: Sequence[NamedPrompt]) -> PoolConfig:
    """A pool shaped like ``model``'s KV, long enough for the longest prompt's output; a
    windowed pool for a model whose every layer slides (one that mixes layer kinds is served
    in the groups `sized_groups` makes of it)."""
    return pool_for_model(
        model.config, longest=max(len(p.token_ids) for p in prompts) + args.max_new_tokens,
        num_requests=len(prompts), draft_len=args.draft_len, dtype=args.dtype,
        device=args.device, tokens_per_block=args.tokens_per_block,
        max_batch_size=args.max_batch_size, num_blocks=args.num_blocks,
        slack_policy=args.slack_policy, window=pool_window(model.config))


def _human_interrupted(s: dict[str, Any]) -> str:
    return (f"kvalloc worker: interrupted after {s['steps']} steps, {s['generated_tokens']} "
            f"tokens, {s['tokens_per_s']:.1f} tokens/s; acceptance {s['acceptance_rate']:.1%}")


def _human(result: dict[str, Any]) -> str:
    lines = [f"{o['id']}: {' '.join(map(str, o['token_ids']))}" for o in result["outputs"]]
    lines.append(f"{result['generated_tokens']} tokens in {result['steps']} steps, "
                 f"{result['tokens_per_s']:.1f} tokens/s; acceptance "
                 f"{result['acceptance_rate']:.1%} ({result['accepted_drafts']}/"
                 f"{result['proposed_drafts']} drafts); kvalloc call "
                 f"{result['call_share']:.1%} of step time; {result['preemptions']} preemptions")
    if result["forwards_ahead"]:
        lines.append(f"{result['forwards_ahead']} of {result['steps']} forwards launched ahead "
                     f"of the host; {result['table_violations']} block-table violations")
    return "\n".join(lines)
