"""CPU kernels and the choice between them: the fp32 GEMM (PyTorch's or oneDNN's,
:mod:`.onednn`), bf16 linear layers (:mod:`.matmul`), and vitflow's own C++ library
(:mod:`.cpp`, sources in ``csrc/``) with its build."""
