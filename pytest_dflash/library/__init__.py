"""Kernel libraries nobody here wrote, as routes (docs/library-routes.md).

flash-linear-attention's gated-delta-rule kernels and gated norm (family ``linear.gdn``), Liger's
RMSNorm and SwiGLU (family ``norm_mlp``) and torch's own SDPA backends forced one at a time
(family ``attn.d256``). Each route is switched in where the modelling code itself dispatches
(:mod:`pytest_dflash.library.dispatch_points`; the transformers engine's switch is
:mod:`pytest_dflash.engines.transformers_library`), and each one's availability probe
(:mod:`pytest_dflash.library.probes`) says why it cannot run here: the library is not installed,
or there is no CUDA device. The route records are in :mod:`pytest_dflash.routes.library`.
Nothing here imports torch or a library at import time.
"""
