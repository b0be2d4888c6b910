"""The native CPU kernels and the fused forwards the ``hf`` engine runs on (C++ in ``csrc/``,
built on first use): the packed linear layers (``native_linear``, int8 heads by ``quantize``),
whole decoder layers and stacks (``native_layers``, ``fused_layers``), the draft head's steps
(``native_draft``), and the check that packed copies still hold their weights (``weight_check``).
Every path computes the same bits as the model's own forward; where one does not apply, the
model's own modules run. Nothing here imports the engine: the engine passes these kernels in.
"""
