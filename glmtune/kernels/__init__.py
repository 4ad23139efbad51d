"""Fast kernels (Triton), each a backend with a pure-torch reference beside it."""
