"""What every ``kvalloc`` command shares, whichever room runs it: argparse types (`arguments`),
a configuration's validation errors in the command's words (`config_errors`), Ctrl-C taken at a
step boundary (`interrupt`), and the sampled draft acceptance of the commands
that simulate a worker, ``simulate`` and ``loadgen`` (`simulated_acceptance`).

Here, not in `allocator.tools`, because `server` and `worker` use it too, and they never import
the simulator's room. Imports no other room of the allocator.
"""
