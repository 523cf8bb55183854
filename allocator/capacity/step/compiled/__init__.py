"""The batched step compiled with numba, for the hot path: `reference`'s phases, one for one.

`reference_step` is the specification; this is the same step written as plain loops over int64
arrays so that numba compiles it to native code: the same checks in the same order (so the same
error for the same bad plan), the same block moves in the same order (so the same block ids,
free stack and table cells), the same outcome and counter deltas. Tests run both on random plans
and compare every array of the state after each step.

One module per phase of `reference`, named for it, each function named as the reference's:

1. `validate`: ``validate``;
2. `settle`: ``settle_step``: reverts, then results, into `Settled` (scratch copies of the row
   state);
3. `demand`: ``plan_grants`` (returns the `Demand`) and ``plan_prefill``;
4. `serve`: ``serve_blocks``: row overflow, blocks served in order (``serve_in_order``, then
   ``serve_hits_in_order`` for the new requests), rows for the new requests (returns `Served`);

and only then, when nothing can fail any more,

5. `replace`: ``replace_state``: the settled and granted state replaces the row state;
6. `move`: ``move_blocks``: new requests take their cached blocks, every row's blocks follow its
   capacity (`block_moves`: ``park_prefix``, ``truncate``, ``take``), finished rows are reset,
   new requests are admitted;
7. `release`: in a windowed group, `windows.release.WindowRelease.release` (the numpy step runs
   that after `reference_step`): the columns behind every window go back to the pool; then
   `move.changes` lists the table cells the step changed.

Beside them: `driver` (`_step`, which runs the phases in order, and `CompiledStep`, which runs it
over a manager's state), `tuples` (the named tuples the phases take, and the indices into their
arrays), `loops` (error reporting and copies every phase uses), `rules` (`accounting`'s rules
for one row), `inlining` (how each function is compiled into `_step`, and why).

A phase that finds bad input writes ``[kind, subject, index, detail]`` (`codes`) into ``error``
and returns at once (its result unfinished); `_step` then returns empty outputs. Nothing is
changed before every check has passed: the settled state is built in scratch arrays and copied
back only then.

Every function here is compiled into `_step` (`inlining`), so the step is still one native
routine, and `_step` its one compiled signature.

numba caches `_step` on disk (``cache=True``, next to `driver` or, when that is not writable, in
numba's user cache directory; ``NUMBA_CACHE_DIR`` overrides both), so only the first process on
a machine pays the compile. numba keys that cache on `driver`'s file alone (`allocator.common.jit`):
after changing any other module here, delete the cached ``*.nbi`` / ``*.nbc`` files, or the old
step runs.
"""

from kvalloc.allocator.capacity.step.compiled.driver import CompiledStep, available

__all__ = ["CompiledStep", "available"]
