"""Target-neutral analyses of the loop-nest IR that code generators share.

Each backend (WebAssembly, CUDA) decides how to render a loop nest from the same questions: how an
index moves with a loop variable (`affine`), which assignments accumulate a reduction
(`reductions`). They are answered here once. This package may import `ir` and `passes`; `ir`
never imports it.
"""
