"""`bertfast bench`: the benchmark command."""
