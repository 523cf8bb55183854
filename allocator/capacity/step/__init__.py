"""The batched step: its input and outcome as arrays (`plan`), the numpy specification
(`reference`), the same step compiled with numba (`compiled`, phase for phase), and the error
codes both report (`codes`)."""
