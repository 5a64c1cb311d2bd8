"""`bertfast validate`: kernels and models against the reference, and the int8 accuracy report."""
