"""The lowest floor: kernels. `triton/` holds the GPU kernels (one module per op); `activation` is the one
table of activation functions every floor above shares. The CPU kernels are C++ (csrc/, `bertfast._C`)."""
