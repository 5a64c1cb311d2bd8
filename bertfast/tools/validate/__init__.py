"""`bertfast validate`: kernels and models against the reference, and the int8 accuracy report.

Modules, each depending only on those before it: `accuracy` (the one accuracy rule, also used by bench,
the tests and benchmarks), `cases` (the op cases), `sweep` (the op sweep), `model_check` (a whole
checkpoint), `sentences` and `int8_report` (the int8 report), `cli` (the command: `add_arguments`, `run`).
"""
